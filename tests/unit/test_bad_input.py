"""Bad input through the real CLI: non-zero exit, a short message naming problem and fix (bad data,
which a real process takes seconds to find: tests/integration/test_bad_data_cli.py)."""

import json
import subprocess
import time

import pytest
from helpers import assert_clear_error, hf_folder, run_cli_train


def test_config_typo_suggests_nearest_key():
    assert_clear_error(
        run_cli_train("configs/tiny.yaml", "train.max_step=5"), "train.max_step", "did you mean 'train.max_steps'"
    )


def test_wrong_type_names_key():
    assert_clear_error(run_cli_train("configs/tiny.yaml", "cluster.num_workers=two"), "cluster.num_workers must be")


def test_nonexistent_config_file():
    assert_clear_error(run_cli_train("configs/nope.yaml"), "config file not found", "configs/nope.yaml")


# -- every section's out-of-range values, through the real CLI -----------------------------------
# (override or overrides, the key its one-line message names). Most run in-process through rayllm.cli.main;
# SUBPROCESS_CASES run as real `python -m rayllm.cli train` processes.
BAD_VALUES = [
    ("run.name=''", "run.name"),
    ("run.dir=''", "run.dir"),
    ("data.seq_len=0", "data.seq_len"),
    ("data.text_field=''", "data.text_field"),
    ("data.tokenizer_sample_docs=0", "data.tokenizer_sample_docs"),
    ("data.shuffle_window=0", "data.shuffle_window"),
    ("data.tokenize_tasks=-1", "data.tokenize_tasks"),
    ("data.wait_timeout_s=0", "data.wait_timeout_s"),
    ("data.on_bad_shard=ignore", "data.on_bad_shard"),
    ("data.val=[]", "data.val"),
    ("data.train=[{path: data/demo/train, weight: -1}]", "data.train[0].weight"),
    ("storage.endpoint_url=minio:9000", "storage.endpoint_url"),
    ("model.vocab_size=1", "model.vocab_size"),
    ("model.norm_eps=0", "model.norm_eps"),
    ("model.rope_theta=-10000", "model.rope_theta"),
    ("model.ffn_hidden=0", "model.ffn_hidden"),
    ("model.ffn_multiple_of=0", "model.ffn_multiple_of"),
    ("model.rope_scaling_factor=0", "model.rope_scaling_factor"),
    (("model.rope_scaling_factor=8", "model.rope_low_freq_factor=4"), "model.rope_low_freq_factor"),
    ("model.dim=100", "model.dim"),
    ("model.init_from=''", "model.init_from"),
    ("train.warmup_steps=-1", "train.warmup_steps"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio"),
    ("train.min_lr_ratio=-0.1", "train.min_lr_ratio"),
    ("train.beta1=1", "train.beta1"),
    ("train.beta2=-0.1", "train.beta2"),
    ("train.lr=nan", "train.lr"),
    ("train.lr=inf", "train.lr"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.stop_at_step=0", "train.stop_at_step"),
    ("train.val_batches=0", "train.val_batches"),
    ("train.sample_tokens=-1", "train.sample_tokens"),
    ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps"),
    ("train.seed=-1", "train.seed"),
    ("train.precision=fp16", "train.precision"),
    ("train.checkpoint_every_s=nan", "train.checkpoint_every_s"),
    ("cluster.cpus_per_worker=0", "cluster.cpus_per_worker"),
    ("cluster.worker_resources={trainer: -1}", "cluster.worker_resources.trainer"),
    ("cluster.max_failures=-2", "cluster.max_failures"),
    ("cluster.resource_wait_s=0", "cluster.resource_wait_s"),
    ("cluster.resize_interval_s=inf", "cluster.resize_interval_s"),
    ("tracking.repo=aim://127.0.0.1:70000", "tracking.repo"),
    ("tracking.repo=aim://127.0.0.1:0", "tracking.repo"),
    ("tracking.flush_timeout_s=-1", "tracking.flush_timeout_s"),
    ("tracking.experiment=''", "tracking.experiment"),
]
SUBPROCESS_CASES = [("train.beta1=1", "train.beta1"), ("cluster.max_failures=-2", "cluster.max_failures")]


@pytest.fixture
def no_workers(monkeypatch):
    """Reaching Ray at all fails the test: every refusal here must come before any worker starts."""
    import ray

    import rayllm.runtime.launch

    def refuse(*args, **kwargs):
        raise AssertionError("the bad value got as far as starting Ray, to start the workers")

    monkeypatch.setattr(rayllm.runtime.launch, "connect_ray", refuse, raising=False)
    monkeypatch.setattr(ray, "init", refuse)


def main_train(capsys, *args: str, limit_s: float = 10) -> subprocess.CompletedProcess:
    """``rayllm train ...`` in this process, as a CompletedProcess, timed: config errors take milliseconds,
    those found by reading the data (a tokenizer pass over a sample) seconds."""
    from rayllm.cli import main

    started = time.perf_counter()
    code = main(["train", *args])
    elapsed = time.perf_counter() - started
    out = capsys.readouterr()
    assert elapsed < limit_s, f"took {elapsed:.1f} s to refuse"
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def assert_one_error_line(proc: subprocess.CompletedProcess, key: str) -> None:
    assert_clear_error(proc, key)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rayllm: error:")]
    assert len(errors) == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("override, key", BAD_VALUES)
def test_every_section_refuses_an_out_of_range_value_by_name(override, key, tmp_path, capsys, no_workers):
    given = override if isinstance(override, tuple) else (override,)
    proc = main_train(capsys, "configs/tiny.yaml", f"run.dir={tmp_path / 'run'}", *given)
    assert_one_error_line(proc, key)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, key", SUBPROCESS_CASES)
def test_an_out_of_range_value_is_refused_in_seconds_by_a_real_process(override, key, tmp_path):
    started = time.perf_counter()
    proc = run_cli_train("configs/tiny.yaml", f"run.dir={tmp_path / 'run'}", override)
    assert_one_error_line(proc, key)
    assert time.perf_counter() - started < 60
    assert not (tmp_path / "run").exists()


def test_a_sequence_longer_than_the_imported_models_context_is_refused(overrides, tmp_path, capsys, no_workers):
    folder = hf_folder(tmp_path / "hf", max_positions=32)
    proc = main_train(
        capsys, "configs/tiny.yaml", *overrides, f"model.init_from={folder}", "data.seq_len=64", limit_s=60
    )
    assert_one_error_line(proc, "data.seq_len 64")
    assert "max_position_embeddings" in proc.stderr and "at most 32" in proc.stderr


def test_a_missing_init_from_folder_is_refused(overrides, tmp_path, capsys, no_workers):
    proc = main_train(capsys, "configs/tiny.yaml", *overrides, f"model.init_from={tmp_path / 'nowhere'}", limit_s=60)
    assert_one_error_line(proc, "model.init_from")


def test_a_validation_set_smaller_than_one_global_batch_is_refused(overrides, tmp_path, capsys, no_workers):
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "tiny.jsonl").write_text(json.dumps({"text": "x = 1\n" * 20}) + "\n")
    proc = main_train(capsys, "configs/tiny.yaml", *overrides, f"data.val={tmp_path / 'val'}", limit_s=60)
    assert_one_error_line(proc, "data.val holds")
    assert "train.global_batch_size = 8" in proc.stderr and "data.val=null" in proc.stderr
