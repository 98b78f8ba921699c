"""Tokenize tasks on a real local Ray: the same rows whatever the number of tasks, and `rayllm bench
tokenize` end to end (the sizing rule alone: tests/unit/test_tokenize_sizing.py)."""

import json

import numpy as np
import pytest

from rayllm.data import encode
from rayllm.data.encode import TokenizePool
from rayllm.data.shard_groups import GroupPacker
from rayllm.data.source import SourceSpec
from rayllm.io.settings import StorageSettings


def _tiny_plan(tmp_path, tokenizer_file, on_bad_shard="error"):
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    shards = []
    for i in range(4):
        docs = [" ".join(words[(i + d + k) % 8] + str(k % (7 + d)) for k in range(120 + 9 * d)) for d in range(90)]
        lines = [json.dumps({"text": d}) for d in docs]
        if i == 2:
            lines[70] = '{"text": '  # a fault deep in the shard, after more than one job of documents
        path = tmp_path / f"part-{i}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        shards.append(str(path))
    return SourceSpec(
        name="train",
        shards=shards,
        weight=1.0,
        text_field="text",
        storage=StorageSettings(),
        tokenizer_json=tokenizer_file.read_text(),
        seq_len=64,
        seed=3,
        mix=4,
        sizes=[(tmp_path / f"part-{i}.jsonl").stat().st_size for i in range(4)],
        on_bad_shard=on_bad_shard,
    )


@pytest.mark.parametrize("tasks", [1, 3])
def test_rows_are_the_same_whatever_the_number_of_tokenize_tasks(
    ray_local, tmp_path, tokenizer_file, monkeypatch, tasks
):
    """Parity with the reading task tokenizing alone, including a shard that fails part way
    (skipped: what it gave before the fault is kept either way)."""
    monkeypatch.setattr(encode, "SIZE_PERIOD_S", 1e9)  # hold the number of tasks where the test sets it
    monkeypatch.setattr(encode, "JOB_DOCS", 16)  # several jobs per shard, read ahead
    plan = _tiny_plan(tmp_path, tokenizer_file, on_bad_shard="skip")
    batch = {"group": np.array([0]), "resume": np.array([""])}
    alone = list(GroupPacker(plan)(batch))
    pool = TokenizePool(plan.tokenizer_json, ceiling=tasks)
    pool.sizer.tasks = tasks
    pooled = list(GroupPacker(plan, pool)(batch))
    assert sum(len(c["index"]) for c in alone) > 200
    assert any((c["index"] < 0).any() for c in alone), "the faulty shard should be marked as skipped"
    assert len(pooled) == len(alone)
    for a, b in zip(alone, pooled, strict=True):
        assert set(a) == set(b)
        for key in a:
            if key != "tokenize_tasks":
                assert np.array_equal(a[key], b[key]), key
    assert {int(c["tokenize_tasks"][0]) for c in pooled} == {tasks}


def test_bench_tokenize_serves_a_low_demand_without_waiting(ray_local, overrides):
    """`rayllm bench tokenize` end to end, small: it runs, and a demand one reading task meets alone is
    served with no data wait once started."""
    from rayllm.bench import tokenize as bench_tokenize
    from rayllm.config import TrainConfig

    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides)
    result = bench_tokenize.run(config, cpus=4, multiples=(0.05,), seconds=3, tokenize_tasks=2)
    row = result["rows"][0]
    assert row["wait_frac_second_half"] <= 0.02, row
    # Served: batches came in the second half. How fast is the bench's to print (served tokens/s
    # against the demand, in its table), not a test's to assert: on a loaded machine sleep
    # overshoot alone moves the rate of ~15 steps of 0.1 s by 10% or more.
    assert row["served_tokens_per_s_second_half"] > 0, row
    assert "wait %" in bench_tokenize.format_result(result)
