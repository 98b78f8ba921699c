"""Bad input through the real CLI: non-zero exit, a short message naming problem and fix."""

import json
import subprocess
import sys

import pytest


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rayllm.cli", "train", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def assert_clear_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("rayllm: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in message, message
    assert "starting at step" not in proc.stdout  # failed before any worker started


def test_config_typo_suggests_nearest_key():
    assert_clear_error(cli("configs/tiny.yaml", "train.max_step=5"), "train.max_step", "did you mean 'train.max_steps'")


def test_wrong_type_names_key():
    assert_clear_error(cli("configs/tiny.yaml", "cluster.num_workers=two"), "cluster.num_workers must be")


def test_nonexistent_config_file():
    assert_clear_error(cli("configs/nope.yaml"), "config file not found", "configs/nope.yaml")


def test_missing_data_path(tmp_path):
    missing = tmp_path / "no-such-dir"
    assert_clear_error(
        cli("configs/tiny.yaml", f"data.train={missing}", f"run.dir={tmp_path / 'run'}", "data.val=null"),
        "no shards found",
        str(missing),
    )


def test_empty_dataset(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "empty.jsonl").write_text("")
    assert_clear_error(
        cli("configs/tiny.yaml", f"data.train={tmp_path / 'data'}", f"run.dir={tmp_path / 'run'}", "data.val=null"),
        "is empty",
    )


@pytest.mark.parametrize("name, content", [("bad.parquet", b"PAR1 not really"), ("bad.jsonl.gz", b"\x1f\x8bnope")])
def test_unreadable_shard(tmp_path, name, content):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "good.jsonl").write_text(json.dumps({"text": "def f():\n    return 1\n" * 50}) + "\n")
    (tmp_path / "data" / name).write_bytes(content)
    assert_clear_error(
        cli("configs/tiny.yaml", f"data.train={tmp_path / 'data'}", f"run.dir={tmp_path / 'run'}", "data.val=null"),
        "unreadable",
        name,
    )
