"""Config: typed tree, dotted overrides, errors that name the key and the nearest valid one."""

import re

import pytest

from rayllm import ConfigError, TrainConfig


def test_tiny_config_loads_with_overrides():
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=["train.max_steps=50", "run.dir=/tmp/r"])
    assert config.train.max_steps == 50
    assert config.run.dir == "/tmp/r"
    assert config.model.dim == 256


def test_typo_names_nearest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_step'.*did you mean 'train.max_steps'"):
        TrainConfig.from_dict({"train": {"max_step": 5}})


def test_typo_in_override_section():
    with pytest.raises(ConfigError, match=r"did you mean 'model'"):
        TrainConfig.from_dict({}, overrides=["modle.dim=3"])


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"train.max_steps must be an integer, got 'many'"):
        TrainConfig.from_dict({}, overrides=["train.max_steps=many"])


def test_yaml_exponent_string_is_a_float():
    assert TrainConfig.from_dict({"train": {"lr": "3e-4"}}).train.lr == pytest.approx(3e-4)


def test_num_workers_int_or_min_max():
    assert TrainConfig.from_dict({}, overrides=["cluster.num_workers=[1, 2]"]).worker_range == (1, 2)
    with pytest.raises(ConfigError, match="min, max"):
        TrainConfig.from_dict({}, overrides=["cluster.num_workers=[2, 1]"])


def test_global_batch_must_split_over_workers():
    with pytest.raises(ConfigError, match="divisible"):
        TrainConfig.from_dict({}, overrides=["train.global_batch_size=12", "train.micro_batch_size=4"])


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        TrainConfig.from_yaml(tmp_path / "nope.yaml")


def test_resolved_config_round_trips():
    config = TrainConfig.from_yaml("configs/tiny.yaml")
    again = TrainConfig.from_dict(__import__("yaml").safe_load(config.to_yaml()))
    assert again == config


def test_credentials_are_redacted_from_the_recorded_config():
    config = TrainConfig.from_dict({}, overrides=["data.storage.key=AKIAXYZ", "data.storage.secret=hunter2"])
    text = str(config.redacted())
    assert "AKIAXYZ" not in text and "hunter2" not in text
    assert config.data.storage.secret == "hunter2"  # still there for the workers


def test_credentials_inside_urls_are_redacted_and_never_in_a_repr():
    config = TrainConfig.from_dict(
        {},
        overrides=[
            "data.storage.endpoint_url=https://minio:pa55word@s3.example.com:9000",
            "data.storage.key=AKIAXYZ",
            "data.storage.secret=hunter2",
        ],
    )
    recorded = config.redacted()
    for text in (str(recorded), repr(config), str(config.data), repr(config.data.storage)):
        assert "pa55word" not in text and "hunter2" not in text and "AKIAXYZ" not in text, text
    assert recorded["data"]["storage"]["endpoint_url"] == "https://<redacted>@s3.example.com:9000"
    assert config.data.storage.credentials()["secret"] == "hunter2"  # still there for this process


def test_unsealed_credentials_refuse_to_travel_while_ray_runs(monkeypatch):
    import pickle

    from rayllm import credentials

    storage = TrainConfig.from_dict({}, overrides=["data.storage.secret=hunter2"]).data.storage
    assert b"hunter2" in pickle.dumps(storage)  # without Ray (torchrun, spawn): passed as is
    monkeypatch.setattr(credentials, "ray_running_here", lambda: True)
    with pytest.raises(RuntimeError, match="sealed"):
        pickle.dumps(storage)


def test_rayllm_train_stays_the_function_once_the_trainer_modules_are_loaded():
    import rayllm
    import rayllm.trainer.launch  # noqa: F401  (what a first train() call imports)

    assert callable(rayllm.train) and rayllm.train.__module__ == "rayllm"


def test_a_cluster_whose_workers_would_take_every_cpu_is_named_before_training_hangs():
    from rayllm.trainer.launch import no_room_for_data

    two = TrainConfig.from_dict({}, overrides=["cluster.num_workers=2"])
    assert "ray start --num-cpus=3" in no_room_for_data(2, two)  # 2 workers, no CPU for data tasks
    assert no_room_for_data(4, two) is None
    assert no_room_for_data(1, two) is None  # too small for the group at all: Ray Train waits for nodes
    assert no_room_for_data(0, two) is None  # a CPU-less autoscaling head
    elastic = TrainConfig.from_dict({}, overrides=["cluster.num_workers=[1, 2]"])
    assert no_room_for_data(2, elastic)  # Ray Train would take both CPUs for 2 workers
    assert no_room_for_data(2.5, elastic) is None


@pytest.mark.parametrize(
    "override,expected",
    [
        ("tracking.repo=aim://127.0.0.1", "write aim://HOST:PORT"),
        ("cluster.health_check_interval_s=0", "cluster.health_check_interval_s must be a positive"),
        ("tracking.flush_timeout_s=-1", "tracking.flush_timeout_s must be >= 0"),
    ],
)
def test_tracking_and_cluster_settings_that_cannot_work_are_refused_by_name(override, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig.from_dict({}, overrides=[override])


def test_cpu_offload_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"train.cpu_offload .*needs cluster.use_gpu: true"):
        TrainConfig.from_dict({}, overrides=["train.cpu_offload=true"])
    assert TrainConfig.from_dict({}, overrides=["train.cpu_offload=true", "cluster.use_gpu=true"]).train.cpu_offload


def test_compile_is_auto_or_a_boolean():
    assert TrainConfig.from_dict({}, overrides=["train.compile=true"]).train.compile is True
    with pytest.raises(ConfigError, match=r"train.compile must be auto, true or false; got 'sometimes'"):
        TrainConfig.from_dict({}, overrides=["train.compile=sometimes"])
