"""Storage outages, delivered as the network delivers them: a TCP proxy in front of moto's S3
server resets every connection, open or new, for a while: once from the data stream's first read
of a shard (Ray Data's tasks retry and resume it), once mid-run from the first request of a
checkpoint's write (DCP's write fails its attempt with a transient error; rank 0's small files and
Ray Train's snapshot retry). 8 s within a 60 s retry deadline: retried; 30 s past a 2 s one: the
attempt restarts. Either way the run finishes, every sequence is trained exactly once in the
seed's order, and the console gets one line per retried operation, no aiohttp traceback."""

from __future__ import annotations

import io
import pathlib
import threading
import time

import numpy as np
import pytest
from helpers import TEST_MODEL, s3_client
from test_exactly_once import G, ids_of, write_small_corpus

from rayllm import TrainConfig, train
from rayllm.bench.fault_proxy import FaultProxy
from rayllm.data.discover import prepare_data
from rayllm.data.order import local_stream

pytestmark = pytest.mark.slow
BUCKET = "outage"


def committed_ids(s3, bucket: str, prefix: str) -> list[tuple]:
    """Every committed checkpoint's recorded sequence ids, step by step, rank 0's rows then rank 1's."""
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    folders = sorted({k.rsplit("/", 1)[0] for k in keys if k.endswith("/rayllm_commit.json")})
    seen = []
    for folder in folders:
        names = sorted(k for k in keys if k.startswith(folder + "/consumed-rank"))
        per_rank = [np.load(io.BytesIO(s3.get_object(Bucket=bucket, Key=k)["Body"].read())) for k in names]
        per_step = G // len(per_rank)
        for step in range(len(per_rank[0]) // per_step):
            for rows in per_rank:
                seen.extend(ids_of(rows[step * per_step : (step + 1) * per_step]))
    return seen


def arm_outages(proxy: FaultProxy, s3, bucket: str, outage_s: float) -> threading.Thread:
    """Two outages of ``outage_s``: one from the data stream's first read of a shard (armed once the
    driver's own look at the data is done: config.yaml is written), one from the first request of
    the checkpoint of step 6, mid-run (armed once the first has happened); moto is watched
    directly, not through the proxy."""

    def wait_for(key: str, deadline: float) -> bool:
        while time.time() < deadline:
            try:
                s3.head_object(Bucket=bucket, Key=key)
                return True
            except Exception:
                time.sleep(0.1)
        return False

    def watch():
        deadline = time.time() + 600
        if wait_for("run/config.yaml", deadline):
            proxy.cut_at(b"/small/part-", outage_s)
        while proxy.cuts < 1 and time.time() < deadline:  # armed at once after: checkpoints come steps later,
            time.sleep(0.05)  # and a watcher slowed by a busy machine could miss step 6's writes
        proxy.cut_at(b"/run/checkpoint_00000006/", outage_s)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("outage_s", "deadline_s"),
    [(8.0, 60), (30.0, 2)],
    ids=["retried-within-the-deadline", "past-the-deadline-the-attempt-restarts"],
)
def test_an_outage_costs_retries_or_a_restart_never_the_run_nor_a_sequence_twice(
    ray_local, tokenizer_file, s3_server, outage_s, deadline_s
):
    import ray

    bucket = f"{BUCKET}-{deadline_s}"
    storage = write_small_corpus(s3_server, bucket)
    proxy = FaultProxy(s3_server)
    storage = [o if not o.startswith("storage.endpoint_url=") else f"storage.endpoint_url={proxy.url}" for o in storage]
    steps = 16
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[
            *TEST_MODEL,
            *storage,
            f"data.tokenizer={tokenizer_file}",
            "data.demo_corpus=false",
            "data.val=null",
            "data.record_ids=true",
            "data.shuffle_window=64",
            f"run.dir=s3://{bucket}/run",
            f"train.max_steps={steps}",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=1000",
            "train.log_every=2",
            "train.sample_tokens=0",
            "tracking.enabled=false",
            "cluster.num_workers=2",
            "cluster.max_failures=10",  # a checkpoint write the outage cut fails its attempt: a restart
            f"storage.retry_deadline_s={deadline_s}",
        ],
    )
    plan = prepare_data(config, log=lambda *_: None).train
    batches = zip(range(steps), local_stream(plan, global_batch=G), strict=False)
    expected = ids_of(np.concatenate([rows for _, (rows, _) in batches])[["source", "epoch", "shard", "index"]])

    armed = arm_outages(proxy, s3_client(s3_server), bucket, outage_s)
    result = train(config, quiet=True)
    armed.join(timeout=1)

    assert proxy.cuts == 2 and proxy.resets > 0, f"{proxy.cuts} of the 2 outages happened"
    assert result.step == steps
    assert committed_ids(s3_client(s3_server), bucket, "run/") == expected  # every sequence once, in the seed's order
    logs = pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    text = "".join(p.read_text(errors="replace") for p in logs.glob("*.err") if p.is_file())
    text += "".join(p.read_text(errors="replace") for p in logs.glob("*.out") if p.is_file())
    # One line per retry episode, naming what was retried: a shard read, a listing or a checkpoint
    # file, whichever the outage met first on this machine.
    assert "[rayllm] storage: " in text
    assert "Task exception was never retrieved" not in text
    failures = [r["message"] for r in result.history if r["kind"] == "failure"]
    if deadline_s < outage_s:  # the stream's read gave up: its attempt restarted, not the run
        assert any(f.startswith(f"StorageUnavailable: reading shard s3://{bucket}/") for f in failures), failures
