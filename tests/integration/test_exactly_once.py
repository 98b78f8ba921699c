"""Exactly once, in one order: sequence ids recorded with each checkpoint through restarts
that change the number of workers (2 -> 1 -> 2) and through a worker killed mid-run form
the seed's global order, each once. The data is read from moto's S3 server on 127.0.0.1."""

import glob
import json

import numpy as np
import pytest
from helpers import kill_actor_after, s3_client

from rayllm import TrainConfig, train
from rayllm.data.discover import prepare_data
from rayllm.data.order import local_stream

pytestmark = pytest.mark.slow
G = 8


@pytest.fixture
def small_corpus(s3_server) -> list[str]:
    """About 190 sequences of 65 tokens in 3 shards on S3, so a test can train through a whole epoch;
    the overrides that read it."""
    return write_small_corpus(s3_server, "exactly-once")


def write_small_corpus(s3_server: str, bucket: str, key: str = "testing", secret: str = "testing") -> list[str]:
    s3 = s3_client(s3_server, key, secret)
    s3.create_bucket(Bucket=bucket)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for s in range(3):
        lines = []
        for d in range(6):
            text = " ".join(words[(s * 7 + d * 3 + i) % len(words)] + str(i % 17) for i in range(160))
            lines.append(json.dumps({"text": text}) + "\n")
        s3.put_object(Bucket=bucket, Key=f"small/part-{s}.jsonl", Body="".join(lines).encode())
    return [
        f"data.train=s3://{bucket}/small",
        f"storage.endpoint_url={s3_server}",
        f"storage.key={key}",
        f"storage.secret={secret}",
        "storage.region=us-east-1",
    ]


def ids_of(rows):
    return [tuple(int(v) for v in r) for r in rows]


def test_ids_form_one_epoch_in_seed_order_through_2_1_2_workers_and_a_kill(
    ray_local, overrides, small_corpus, tmp_path, monkeypatch
):
    """... and through a hang: on the last 2 workers, rank 1 sleeps inside step 11; the watchdog
    names it with its stack and Ray Train restarts the attempt from the checkpoint of step 10."""
    base = [
        *overrides,
        *small_corpus,
        "data.val=null",
        "data.record_ids=true",
        "data.shuffle_window=64",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1000",
        "train.log_every=2",
        "train.hang_timeout_s=3",
        "tracking.enabled=false",
    ]
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=base)
    plan = prepare_data(config, log=lambda *_: None).train
    batches = []
    for rows, _ in local_stream(plan, global_batch=G):  # endless epochs: stop once epoch 0 is behind
        batches.append(rows)
        if (rows["epoch"] > 0).all():
            break
    stream = np.concatenate(batches)
    last_of_epoch0 = int(np.flatnonzero(stream["epoch"] == 0)[-1])
    steps = last_of_epoch0 // G + 1  # the steps that hold every sequence of epoch 0
    assert steps >= 12, f"the small corpus should give at least 12 steps, got {steps}"
    expected = ids_of(stream[: steps * G][["source", "epoch", "shard", "index"]])
    epoch0 = {e for e in expected if e[1] == 0}
    assert len(epoch0) == int((stream["epoch"] == 0).sum())

    killed: list[int] = []
    hang_marker = tmp_path / "hung"
    for workers, stop, kill_at in ((2, 4, None), (1, 9, 6), (2, steps, None)):
        if stop == steps:
            monkeypatch.setenv("RAYLLM_FAULT_HANG_AT", f"11:1:{hang_marker}")
        watcher = kill_actor_after(str(tmp_path / "run"), kill_at, "RayTrainWorker", killed) if kill_at else None
        result = train(
            TrainConfig.from_yaml(
                "configs/tiny.yaml",
                overrides=[
                    *base,
                    f"train.max_steps={steps}",
                    f"cluster.num_workers={workers}",
                    f"train.stop_at_step={stop}",
                    "cluster.max_failures=1",
                ],
            ),
            quiet=True,
        )
        assert result.step == stop
        if watcher is not None:
            watcher.join(timeout=1)
            assert killed, "the worker was not killed"
            restarts = [r for r in result.history if r["kind"] == "start" and r["restarts"] > 0]
            assert len([r for r in result.history if r["kind"] == "start"]) == 2, "the kill should cause a restart"
            assert restarts
    assert hang_marker.exists(), "the hang was not injected"
    failures = [r for r in result.history if r["kind"] == "failure"]
    assert any("hang: no step finished" in f["message"] and "rank 1 on node" in f["message"] for f in failures)
    (summary,) = glob.glob(str(tmp_path / "run" / "hangs" / "attempt-*" / "summary.txt"))
    assert "maybe_hang" in open(summary).read() and "did not reach the end of step 11" in open(summary).read()
    assert [r["step"] for r in result.history if r["kind"] == "start"][-1] in (9, 10)  # step 10 may be uncommitted

    # Rebuild the global order: per checkpoint, per step, rank 0's rows then rank 1's.
    seen = []
    for ckpt in sorted(glob.glob(str(tmp_path / "run" / "checkpoint_[0-9]*"))):
        per_rank = [np.load(p) for p in sorted(glob.glob(f"{ckpt}/consumed-rank*.npy"))]
        world = len(per_rank)
        per_step = G // world
        for step in range(len(per_rank[0]) // per_step):
            for rows in per_rank:
                seen.extend(ids_of(rows[step * per_step : (step + 1) * per_step]))
    assert len(seen) == len(set(seen)), "a sequence was trained on twice"
    assert seen == expected  # in the seed's order, whatever the world size
    assert epoch0 <= set(seen)  # every sequence of epoch 0, each once
