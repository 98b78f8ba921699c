"""Faults on the Ray path that used to hang, leak or retry for ever.

One run reads its data from moto's S3 with marker credentials while its data stream server
is killed mid-run: it finishes with every sequence exactly once, says what happened, and the
marker is in no file of the run, no Ray log and no state-API output. A deterministic error with
``cluster.max_failures: -1`` ends the run after two attempts with its message.
"""

from __future__ import annotations

import glob
import pathlib
import time

import numpy as np
import pytest
from helpers import TEST_MODEL, kill_actor_after, read_records, s3_client
from test_exactly_once import G, ids_of, write_small_corpus

from rayllm import RayllmError, TrainConfig, train
from rayllm.data.discover import prepare_data
from rayllm.data.order import local_stream
from rayllm.data.stream.server import MAX_DEPTH

pytestmark = pytest.mark.slow
KEY, SECRET, SESSION = "AKIAMARKERKEY7731", "marker-secret-5f0c2a9e", "marker-session-91d3"
SIGNATURE, CREDENTIAL, PASSWORD = "marker-signature-44ab", "marker-credential-0e7f", "marker-password-c2d8"
MARKERS = (KEY, SECRET, SESSION, SIGNATURE, CREDENTIAL, PASSWORD)


def secret_paths(s3_server: str, tokenizer_file: str) -> list[str]:
    """Paths with secrets of their own, on moto over plain HTTP (which ignores them): a signed
    URL as a mixture source (read by the stream server's Ray Data tasks), a password URL as the
    validation set (read by the driver) and a signed tokenizer; plus a session token. (moto serves
    an object to a request that is signed, or looks signed, or has a password, and ignores both.)"""
    s3 = s3_client(s3_server, KEY, SECRET)
    s3.copy_object(Bucket="marked-run", Key="signed/part-9.jsonl", CopySource="marked-run/small/part-2.jsonl")
    s3.put_object(Bucket="marked-run", Key="tok/tokenizer.json", Body=pathlib.Path(tokenizer_file).read_bytes())
    host = s3_server.removeprefix("http://")
    signed = f"http://{host}/marked-run/signed/part-9.jsonl?X-Amz-Credential={CREDENTIAL}&X-Amz-Signature={SIGNATURE}"
    return [
        f"data.train=[{{path: s3://marked-run/small, weight: 2}}, {{path: '{signed}', weight: 1}}]",
        f"data.val=http://reader:{PASSWORD}@{host}/marked-run/small/part-0.jsonl",
        f"data.tokenizer=http://{host}/marked-run/tok/tokenizer.json?X-Amz-Security-Token={CREDENTIAL}&X-Amz-Signature={SIGNATURE}",
        f"storage.session_token={SESSION}",
    ]


@pytest.fixture(scope="module")
def marked_run(ray_local, tokenizer_file, s3_server, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("marked")
    overrides = write_small_corpus(s3_server, "marked-run", KEY, SECRET)
    base = [
        *TEST_MODEL,
        *overrides,
        *secret_paths(s3_server, tokenizer_file),
        "data.demo_corpus=false",
        "train.val_every=1000",  # validation at step 0 and at the end: the driver reads data.val
        "data.record_ids=true",
        "data.shuffle_window=64",
        f"run.dir={tmp_path / 'run'}",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=1000",
        "train.log_every=2",
        "train.sample_tokens=0",
        "cluster.num_workers=2",
        "cluster.max_failures=2",
    ]
    # More steps than the server runs ahead (MAX_DEPTH): it cannot have served them all before its kill.
    steps = MAX_DEPTH + 8
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*base, f"train.max_steps={steps}"])
    plan = prepare_data(config, log=lambda *_: None).train
    batches = zip(range(steps), local_stream(plan, global_batch=G), strict=False)
    stream = np.concatenate([rows for _, (rows, _) in batches])
    expected = ids_of(stream[["source", "epoch", "shard", "index"]])
    killed: list[int] = []
    watcher = kill_actor_after(str(tmp_path / "run"), 6, "StreamServer", killed)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")  # Ray Train's run record, as the dashboard shows it
        result = train(config, quiet=True)
    watcher.join(timeout=1)
    return {"result": result, "expected": expected, "killed": killed, "run_dir": tmp_path / "run", "config": config}


def test_a_killed_data_stream_server_costs_a_restart_not_the_run(marked_run):
    result = marked_run["result"]
    assert marked_run["killed"], "the stream server was not killed"
    assert result.step == MAX_DEPTH + 8
    failures = [r for r in result.history if r["kind"] == "failure"]
    assert failures and "data stream server died" in failures[0]["message"], failures
    starts = [r for r in result.history if r["kind"] == "start"]
    assert len(starts) == 2 and starts[1]["step"] >= 2  # resumed from a checkpoint, not from 0
    seen = []
    for ckpt in sorted(glob.glob(str(marked_run["run_dir"] / "checkpoint_[0-9]*"))):
        per_rank = [np.load(p) for p in sorted(glob.glob(f"{ckpt}/consumed-rank*.npy"))]
        per_step = G // len(per_rank)
        for step in range(len(per_rank[0]) // per_step):
            for rows in per_rank:
                seen.extend(ids_of(rows[step * per_step : (step + 1) * per_step]))
    assert seen == marked_run["expected"]  # every sequence once, in the seed's order


def test_credentials_reach_no_file_log_state_or_repr(marked_run):
    """Storage keys, a session token and the secrets inside path fields (a signed mixture source,
    a password validation URL, a signed tokenizer URL): in no file of the run, no Ray log, no
    state-API output (actors, tasks, jobs, Ray Train's run record), no repr, no summary."""
    import ray
    from ray.util.state import list_actors, list_jobs, list_tasks

    from rayllm.runtime.launch import format_summary

    markers = tuple(m.encode() for m in MARKERS)
    places = [pathlib.Path(marked_run["run_dir"])]  # checkpoints, metrics.jsonl, config.yaml, the Aim repo
    places.append(pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs")
    leaks = []
    for place in places:
        for path in place.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                leaks += [f"{path}: {m.decode()}" for m in markers if m in data]
    assert not leaks, leaks
    state = repr(list_actors(detail=True, limit=10000)) + repr(list_tasks(detail=True, limit=10000))
    state += repr(list_jobs(detail=True)) + train_run_records()
    assert not [m for m in MARKERS if m in state]
    config, result = marked_run["config"], marked_run["result"]
    assert (
        result.data_report["mixture"] and "part-9.jsonl" in result.data_report["mixture"]
    )  # the signed source trained
    assert result.initial_val_loss  # the password URL was read
    shown = repr(config) + format_summary(result) + repr(result.data_report)
    assert not [m for m in MARKERS if m in shown], shown
    for shown in (str(config.data), repr(config.storage), repr(prepare_data(config).train)):
        assert KEY not in shown and SECRET not in shown and SESSION not in shown


def train_run_records() -> str:
    """What Ray Train's state actor records of each run (its dashboard's /api/train/v2/runs):
    the train_loop_config as text, the run config, the storage path."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    assert actor is not None, "Ray Train recorded no run"
    return repr(ray.get(actor.get_train_runs.remote(), timeout=30))


def test_an_error_that_repeats_at_the_same_step_ends_the_run_after_two_attempts(ray_local, overrides, monkeypatch):
    monkeypatch.setenv("RAYLLM_FAULT_RAISE_AT", "3")
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[
            *overrides,
            "data.val=null",
            "train.max_steps=6",
            "train.checkpoint_every=2",
            "train.sample_tokens=0",
            "tracking.enabled=false",
            "cluster.num_workers=1",
            "cluster.max_failures=-1",  # retried for ever, were it not deterministic
        ],
    )
    with pytest.raises(RayllmError, match="failed the same way at step 2 on a fresh attempt") as caught:
        train(config, quiet=True)
    assert "injected deterministic failure in step 3" in str(caught.value)
    assert len(read_records(config.run.dir, "start")) == 2


def test_a_stalled_data_stream_is_an_error_naming_the_wait(ray_local):
    import ray

    from rayllm.data.stream.protocol import DataStreamLost
    from rayllm.data.stream.relay import served_batches

    @ray.remote(num_cpus=0)
    class Stalled:
        def steps(self, attempt: int, local_ranks: int, rank: int, held: int) -> list:
            time.sleep(60)
            return []

    @ray.remote(num_cpus=0)
    class Empty:  # alive and answering, but never with data
        def steps(self, attempt: int, local_ranks: int, rank: int, held: int) -> list:
            time.sleep(0.2)
            return []

    for relay in (Stalled.remote(), Empty.remote()):
        started = time.time()
        with pytest.raises(DataStreamLost, match=r"rank 1 waited 1 s \(data.wait_timeout_s\) for its next batch"):
            next(served_batches(relay, 1, 1, 1, timeout_s=1.0))
        assert time.time() - started < 30
