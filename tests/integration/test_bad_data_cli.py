"""Bad data through a real `python -m rayllm.cli train` process: a missing path, an empty dataset and
unreadable shards end it with exit code 2 and one line naming the problem, before any worker
starts. Each process imports the trainer and reads the data: seconds each, so not in tests/unit
(the config's bad values, mostly in process: tests/unit/test_bad_input.py)."""

import json

import pytest
from helpers import assert_clear_error, run_cli_train


def test_missing_data_path(tmp_path):
    missing = tmp_path / "no-such-dir"
    assert_clear_error(
        run_cli_train("configs/tiny.yaml", f"data.train={missing}", f"run.dir={tmp_path / 'run'}", "data.val=null"),
        "no shards found",
        str(missing),
    )


def test_empty_dataset(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "empty.jsonl").write_text("")
    assert_clear_error(
        run_cli_train(
            "configs/tiny.yaml", f"data.train={tmp_path / 'data'}", f"run.dir={tmp_path / 'run'}", "data.val=null"
        ),
        "is empty",
    )


@pytest.mark.parametrize("name, content", [("bad.parquet", b"PAR1 not really"), ("bad.jsonl.gz", b"\x1f\x8bnope")])
def test_unreadable_shard(tmp_path, name, content):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "good.jsonl").write_text(json.dumps({"text": "def f():\n    return 1\n" * 50}) + "\n")
    (tmp_path / "data" / name).write_bytes(content)
    assert_clear_error(
        run_cli_train(
            "configs/tiny.yaml", f"data.train={tmp_path / 'data'}", f"run.dir={tmp_path / 'run'}", "data.val=null"
        ),
        "unreadable",
        name,
    )
