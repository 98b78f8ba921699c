"""Config: typed tree, dotted overrides, errors that name the key and the nearest valid one."""

import dataclasses
import json
import re
import types
import typing

import pytest
from helpers import REPO, hf_folder

from rayllm import ConfigError, TrainConfig
from rayllm.config import RANGES
from rayllm.errors import DataError


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
    config = TrainConfig.from_dict({}, overrides=["storage.key=AKIAXYZ", "storage.secret=hunter2"])
    text = str(config.redacted())
    assert "AKIAXYZ" not in text and "hunter2" not in text
    assert config.storage.secret == "hunter2"  # still there for the workers


def test_credentials_inside_urls_are_redacted_and_never_in_a_repr():
    config = TrainConfig.from_dict(
        {},
        overrides=[
            "storage.endpoint_url=https://minio:pa55word@s3.example.com:9000",
            "storage.key=AKIAXYZ",
            "storage.secret=hunter2",
        ],
    )
    recorded = config.redacted()
    for text in (str(recorded), repr(config), str(config.data), repr(config.storage)):
        assert "pa55word" not in text and "hunter2" not in text and "AKIAXYZ" not in text, text
    assert recorded["storage"]["endpoint_url"] == "https://<redacted>@s3.example.com:9000"
    assert config.storage.credentials()["secret"] == "hunter2"  # still there for this process


def test_unsealed_credentials_refuse_to_travel_while_ray_runs(monkeypatch):
    import pickle

    from rayllm.io import credentials

    storage = TrainConfig.from_dict({}, overrides=["storage.secret=hunter2"]).storage
    monkeypatch.setattr(credentials, "ray_running_here", lambda: False)  # a Ray of an earlier test may run
    assert b"hunter2" in pickle.dumps(storage)  # without Ray (torchrun, spawn): passed as is
    monkeypatch.setattr(credentials, "ray_running_here", lambda: True)
    with pytest.raises(RuntimeError, match="sealed"):
        pickle.dumps(storage)


def test_rayllm_train_stays_the_function_once_the_trainer_modules_are_loaded():
    import rayllm
    import rayllm.runtime.launch  # noqa: F401  (what a first train() call imports)

    assert callable(rayllm.train) and rayllm.train.__module__ == "rayllm"


def test_a_cluster_whose_workers_would_take_every_cpu_is_named_before_training_hangs():
    from rayllm.runtime.room import no_room_for_data

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
        ("cluster.health_check_interval_s=0", "cluster.health_check_interval_s must be > 0 or null, got 0.0"),
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


def _leaves(cls: type, prefix: str = "") -> dict[str, typing.Any]:
    """Every key of a config dataclass tree with its type, sections walked into."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_leaves(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = hints[f.name]
    return out


def _scalars(tp: typing.Any) -> tuple:
    """The plain types a key takes: ``float | None`` gives (float, None); lists and mappings none."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return () if typing.get_origin(tp) else (tp,)


def test_every_number_in_the_tree_has_a_decided_range():
    # cluster.num_workers (an int or [min, max]), cluster.worker_resources (a mapping) and the
    # parallel degrees (a number or auto: rayllm.parallel.layout) have their own checks.
    numbers = {k for k, tp in _leaves(TrainConfig).items() if {int, float} & set(_scalars(tp))}
    numbers -= {"cluster.num_workers", "parallel.dp_shard", "parallel.dp_replicate", "parallel.tp"}
    numbers -= {"parallel.pp_stages_per_rank"}  # a number or auto: rayllm.parallel.pp.plan_pipeline
    assert numbers == set(RANGES), "a numeric key without a range in rayllm.config.RANGES, or a stale entry"


FLOAT_KEYS = sorted(k for k, tp in _leaves(TrainConfig).items() if float in _scalars(tp))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_no_float_key_takes_nan_or_infinity(key, value):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be a finite number .*, got {value}; "):
        TrainConfig.from_dict({}, overrides=[f"{key}={value}"])


def test_range_messages_are_one_line_naming_key_value_range_and_fix():
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({}, overrides=["train.min_lr_ratio=1.5"])
    assert str(e.value) == (
        "train.min_lr_ratio must be in [0, 1], got 1.5; set the final learning rate as a fraction of train.lr, "
        "for example 0.1"
    )
    for override in (
        "train.grad_clip=0",
        "train.warmup_steps=0",
        "train.max_nonfinite_steps=null",
        "cluster.max_failures=-1",
    ):
        TrainConfig.from_dict({}, overrides=[override])  # the edges of their ranges: off, or without limit


# -- resolve: model.init_from is read on the driver, never in validation ---------------------------
def test_validation_reads_no_model_folder(tmp_path):
    config = TrainConfig.from_dict({}, overrides=[f"model.init_from={tmp_path / 'nowhere'}", "model.dim=999"])
    assert config.model.dim == 999  # the YAML's, until rayllm.config.resolve reads the folder


def test_resolve_takes_the_shape_and_tokenizer_from_the_folder(tmp_path):
    from rayllm.config.resolve import resolve

    folder = hf_folder(tmp_path / "hf")
    config = TrainConfig.from_dict({}, overrides=[f"model.init_from={folder}", "model.dim=999", "data.seq_len=128"])
    assert resolve(config) is config
    m = config.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size, m.ffn_hidden) == (64, 2, 4, 2, 1024, 192)
    assert (m.norm_eps, m.rope_theta, m.tie_embeddings) == (1e-6, 500000.0, True)
    assert config.data.tokenizer == f"{folder}/tokenizer.json"
    # Workers get this tree: it rebuilds without the folder and without reading it again.
    (tmp_path / "hf" / "config.json").unlink()
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_resolve_refuses_a_sequence_longer_than_the_folders_context(tmp_path):
    from rayllm.config.resolve import resolve

    folder = hf_folder(tmp_path / "hf", max_positions=128)
    config = TrainConfig.from_dict({}, overrides=[f"model.init_from={folder}", "data.seq_len=256"])
    with pytest.raises(ConfigError) as e:
        resolve(config)
    message = str(e.value)
    assert "\n" not in message and "data.seq_len 256" in message and "128" in message
    assert "set data.seq_len to at most 128" in message


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model.init_from: .*not a Llama"),
        ({"rms_norm_eps": 0}, "model.init_from: the shape .* is refused: model.norm_eps must be > 0"),
        ({"num_attention_heads": None}, "model.init_from: .*config.json lacks or mistypes"),
    ],
)
def test_resolve_names_a_folder_it_cannot_use(tmp_path, changes, expected):
    from rayllm.config.resolve import resolve

    config = TrainConfig.from_dict({}, overrides=[f"model.init_from={hf_folder(tmp_path / 'hf', **changes)}"])
    with pytest.raises(ConfigError, match=expected):
        resolve(config)
    with pytest.raises(ConfigError, match="model.init_from: .*does not exist"):
        resolve(TrainConfig.from_dict({}, overrides=[f"model.init_from={tmp_path / 'nowhere'}"]))


def test_rayllm_config_prints_the_resolved_tree(tmp_path, capsys):
    import yaml

    from rayllm.cli import main

    folder = hf_folder(tmp_path / "hf")
    assert main(["config", "configs/tiny.yaml", f"model.init_from={folder}", "data.seq_len=64"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["dim"] == 64 and printed["data"]["tokenizer"] == f"{folder}/tokenizer.json"


# -- a validation set smaller than one global batch ------------------------------------------------
def test_a_validation_set_smaller_than_one_global_batch_is_refused_before_workers(overrides, tmp_path):
    from rayllm.data.discover import prepare_data

    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "tiny.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x + 1\n" * 12}) + "\n")
    config = TrainConfig.from_dict({}, overrides=[*overrides, f"data.val={tmp_path / 'val'}"])
    with pytest.raises(DataError) as e:
        prepare_data(config, log=lambda *_: None)
    message = str(e.value)
    assert "\n" not in message and message.startswith("data.val holds ")
    assert "train.global_batch_size = 8" in message and "data.val=null" in message
    held = int(message.split()[2])
    assert 0 < held < 8
    # One global batch is enough: the same set passes with a batch it fills.
    small = TrainConfig.from_dict(
        {},
        overrides=[
            *overrides,
            f"data.val={tmp_path / 'val'}",
            f"train.global_batch_size={held}",
            "cluster.num_workers=1",
            "train.micro_batch_size=1",
        ],
    )
    assert prepare_data(small, log=lambda *_: None).val is not None


# -- no import circles -------------------------------------------------------------------------------
def _rayllm_imports() -> dict[str, tuple[set[str], set[str]]]:
    """Each rayllm module's rayllm imports: (at module level, anywhere including inside functions)."""
    import ast
    import pathlib

    import rayllm

    root = pathlib.Path(rayllm.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = ("rayllm", *path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        top, anywhere = set(), set()
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inner = {id(n) for f in functions for n in ast.walk(f) if n is not f}
        typing_only = [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
        never_run = {id(n) for block in typing_only for n in ast.walk(block)}  # annotations only
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayllm"):
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in names else node.module for t in targets]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("rayllm")]
            else:
                continue
            if id(node) in never_run:
                continue
            found = {t for t in targets if t in names and t != name}
            anywhere |= found
            if id(node) not in inner:
                top |= found
        graph[name] = (top, anywhere)
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        here = todo.pop()
        if here == goal and seen:
            return True
        if here not in seen:
            seen.add(here)
            todo.extend(graph.get(here, ()))
    return False


def test_no_module_imports_itself_back():
    graph = _rayllm_imports()
    top = {name: edges[0] for name, edges in graph.items()}
    circles = sorted(name for name in top if _reaches(top, name, name))
    assert not circles, f"module-level import circles through {circles}"
    anywhere = {name: edges[1] for name, edges in graph.items()}
    circles = sorted(name for name in anywhere if _reaches(anywhere, name, name))
    assert not circles, f"import circles through function-level imports: {circles}"


def test_a_local_run_dir_is_made_absolute_on_the_driver(tmp_path, monkeypatch):
    """Ray Train's workers run in a folder of their own: a relative run.dir there names another place."""
    from rayllm.config.resolve import resolve

    monkeypatch.chdir(tmp_path)
    config = resolve(TrainConfig.from_yaml(str(REPO / "configs/tiny.yaml"), overrides=["run.dir=runs/x"]))
    assert config.run.dir == str(tmp_path / "runs" / "x")
    remote = resolve(TrainConfig.from_yaml(str(REPO / "configs/tiny.yaml"), overrides=["run.dir=s3://b/r"]))
    assert remote.run.dir == "s3://b/r"
