"""A run owns its run.dir (checkpoint/lease.py), with real processes: a second run on a live
run's dir is refused with one line (torchrun's rank 0 and the Ray driver alike) while the first
finishes untouched; a run whose driver was killed is resumed once its lease expired; the lease
works on object storage (moto's S3 server). Also the end of a run's own deadline, the in-memory
budget refused before any worker starts, and a stalled keeper kept by the registry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO, assert_clear_error, cli_train_cmd, ray_head, read_records, s3_client, torchrun_cmd

from rayllm.bench.fault_proxy import FaultProxy
from rayllm.checkpoint.lease import LEASE_FILE, LeaseOwner, LeaseRecord, RunDirLease, RunDirTaken, read_lease
from rayllm.io.settings import StorageSettings

pytestmark = pytest.mark.slow

PAUSE = "RAYLLM_FAULT_PAUSE_AT"


def _wait_for(condition, seconds: float, what: str) -> None:
    until = time.time() + seconds
    while not condition():
        assert time.time() < until, f"timed out waiting for {what}"
        time.sleep(0.2)


def _first_run(overrides: list[str], run_dir: Path, hold: Path, *extra: str) -> subprocess.Popen:
    """A real torchrun run (one rank) that holds before step 3 while ``hold`` exists."""
    hold.touch()
    cmd = torchrun_cmd(1, [*overrides, *extra])
    env = {**os.environ, PAUSE: f"3:{hold}"}
    log = open(hold.with_suffix(".log"), "w")  # a file, not a pipe: a killed job leaves no reader waiting
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    committed = run_dir / "checkpoint_00000002" / "rayllm_commit.json"
    _wait_for(lambda: committed.exists() or proc.poll() is not None, 300, "the first checkpoint")
    assert proc.poll() is None, hold.with_suffix(".log").read_text()[-3000:]
    return proc


# Synchronous checkpoints: step 2's is committed before the hold at step 3.
SMALL = [
    "train.max_steps=6",
    "train.checkpoint_every=2",
    "train.async_checkpoint=false",
    "train.log_every=1",
    "train.val_every=100",
]


def test_a_second_run_on_a_live_run_dir_is_refused_and_the_first_finishes_untouched(
    overrides, corpus, tokenizer_file, tmp_path
):
    run_dir = tmp_path / "run"
    first = _first_run(overrides, run_dir, tmp_path / "hold", *SMALL, "tracking.enabled=false")
    try:
        owner = read_lease(str(run_dir), StorageSettings()).owner
        # The Ray driver: refused before Ray, data or any worker.
        cli = cli_train_cmd(corpus, tokenizer_file, run_dir, "tracking.enabled=false", *SMALL)
        proc = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert_clear_error(proc, str(run_dir), f"pid {owner.pid}", "since", "another run.dir")
        # torchrun's rank 0, and every rank with it.
        second = subprocess.run(
            torchrun_cmd(1, [*overrides, *SMALL]), cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert second.returncode != 0 and f"is in use by run {owner.id}" in second.stderr, second.stderr[-3000:]
    finally:
        (tmp_path / "hold").unlink()
    assert first.wait(timeout=300) == 0, (tmp_path / "hold.log").read_text()[-3000:]
    records = read_records(run_dir)
    assert [r["kind"] for r in records].count("start") == 1  # nobody else's records in between
    assert sorted(r["step"] for r in records if r["kind"] == "train") == list(range(1, 7))
    for marker in run_dir.glob("checkpoint_*/rayllm_commit.json"):
        assert json.loads(marker.read_text())["owner"] == owner.id
    assert not (run_dir / LEASE_FILE).exists()  # released at the end


def test_a_run_whose_job_was_killed_is_resumed_at_once_on_the_same_host(overrides, tmp_path):
    """Its lease is still fresh, but its process (torchrun's agent) is gone: no wait for the timeout.
    (Another host's lease waits for its heartbeat to age: test_lease.py.)"""
    run_dir = tmp_path / "run"
    quick = [*SMALL, "tracking.enabled=false"]
    first = _first_run(overrides, run_dir, tmp_path / "hold", *quick)
    _kill_job(first)  # the whole job gone at once: nobody releases the lease
    dead = read_lease(str(run_dir), StorageSettings())
    assert time.time() - dead.heartbeat_at < dead.timeout_s  # live by its heartbeat
    records = _records_of(overrides, quick, run_dir)
    output = records.pop()
    taken = f"taking over the lease of run {dead.owner.id}"
    assert taken in output["stderr"] and "its process is gone" in output["stderr"], output["stderr"][-3000:]
    starts = [r for r in records if r["kind"] == "start"]
    assert starts[-1]["step"] == 2  # resumed from the killed run's checkpoint
    assert max(r["step"] for r in records if r["kind"] == "train") == 6


def test_a_run_whose_lease_was_taken_over_stops_naming_the_new_owner_and_writes_nothing_more(overrides, tmp_path):
    """The first run falls silent past its lease's timeout (its rank 0 SIGSTOPped, as a paused VM
    or a long storage cut would), a second process takes the lease over; woken, the first stops at
    its next step without writing or committing another checkpoint, naming the new owner."""
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    first = _first_run(overrides, run_dir, hold, *SMALL, "tracking.enabled=false", "run.lease_timeout_s=2")
    rank0 = _children(first.pid)[0]
    taker = None
    try:
        os.kill(rank0, signal.SIGSTOP)
        taker = subprocess.Popen(
            [sys.executable, "-c", TAKER, str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert taker.stdout.readline().startswith("holding"), taker.communicate(timeout=30)[0]
        new_owner = read_lease(str(run_dir), StorageSettings()).owner
        os.kill(rank0, signal.SIGCONT)
        log = hold.with_suffix(".log")
        _wait_for(lambda: "the lease was taken over by" in log.read_text(), 30, "the first run to see its lease taken")
        hold.unlink()  # on to step 3: the stop, and the checkpoint it would write
        assert first.wait(timeout=300) != 0
    finally:
        if taker is not None:
            taker.kill()
        if first.poll() is None:
            _kill_job(first)
    output = log.read_text()
    assert f"was taken over by run {new_owner.id}" in output and f"pid {new_owner.pid}" in output, output[-3000:]
    assert "stopping without writing the checkpoint of step 3" in output, output[-3000:]
    assert not (run_dir / "checkpoint_00000003").exists(), "nothing written after the takeover"
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_00000002"]
    assert read_lease(str(run_dir), StorageSettings()).owner.id == new_owner.id, "the new owner keeps its lease"


# A second run's driver, as far as the lease goes: takes it over and holds it until killed.
TAKER = textwrap.dedent(
    """
    import sys, time
    from rayllm.checkpoint.lease import RunDirLease, RunDirTaken
    from rayllm.io.settings import StorageSettings
    lease = RunDirLease(sys.argv[1], StorageSettings(), 60.0, log=lambda text: None)
    deadline = time.time() + 60
    while True:
        try:
            lease.acquire()  # refused while the silent run's heartbeat is younger than its timeout
            break
        except RunDirTaken:
            assert time.time() < deadline, "the silent run's lease never expired"
            time.sleep(0.5)
    print("holding", flush=True)
    time.sleep(300)
    """
)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's ranks), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def _kill_job(agent: subprocess.Popen) -> None:
    """SIGKILL torchrun's agent and its ranks (each rank is a session of its own)."""
    for pid in [agent.pid, *_children(agent.pid)]:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=120)


def _records_of(overrides, extra, run_dir) -> list[dict]:
    proc = subprocess.run(torchrun_cmd(1, [*overrides, *extra]), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [*read_records(run_dir), {"kind": "output", "stderr": proc.stderr}]


def test_the_lease_works_on_object_storage(s3_server):
    s3_client(s3_server).create_bucket(Bucket="rayllm-lease")
    storage = StorageSettings(endpoint_url=s3_server, key="testing", secret="testing", region="us-east-1")
    run_dir = "s3://rayllm-lease/runs/one"
    first = RunDirLease(run_dir, storage, timeout_s=5.0)
    first.acquire()
    with pytest.raises(RunDirTaken, match="s3://rayllm-lease/runs/one is in use by run " + first.owner.id):
        RunDirLease(run_dir, storage, timeout_s=5.0).acquire()
    first.release()
    assert read_lease(run_dir, storage) is None
    gone = LeaseRecord(LeaseOwner("gone", "old-host", 1, 0.0), heartbeat_at=time.time() - 60, timeout_s=5.0)
    s3_client(s3_server).put_object(
        Bucket="rayllm-lease", Key=f"runs/one/{LEASE_FILE}", Body=json.dumps(gone.to_json())
    )
    said: list[str] = []
    taker = RunDirLease(run_dir, storage, timeout_s=5.0, log=said.append)
    taker.acquire()
    assert "taking over the lease of run gone" in said[0] and read_lease(run_dir, storage).owner == taker.owner
    taker.release()


def test_the_heartbeat_outlives_a_storage_outage_past_the_retry_deadline(s3_server):
    """Renewals fail through an outage that outlasts storage.retry_deadline_s (StorageUnavailable,
    or whatever the storage client raises as its own type); the renewal thread must beat again
    afterwards, not die and let the lease lapse."""
    s3_client(s3_server).create_bucket(Bucket="rayllm-lease-outage")
    proxy = FaultProxy(s3_server)
    storage = StorageSettings(
        endpoint_url=proxy.url, key="testing", secret="testing", region="us-east-1", retry_deadline_s=0.5
    )
    run_dir = "s3://rayllm-lease-outage/run"
    said: list[str] = []
    lease = RunDirLease(run_dir, storage, timeout_s=4.0, log=said.append)
    lease.acquire()
    try:
        first = read_lease(run_dir, storage).heartbeat_at
        # A failed call takes seconds (s3fs's and botocore's own retries), two make an episode
        # past its 0.5 s deadline: 20 s are several failed beats.
        proxy.cut(20.0)
        time.sleep(20.5)
        deadline = time.time() + 90  # a call in flight when the outage ends may take a while to fail
        while read_lease(run_dir, storage).heartbeat_at <= first + 20 and time.time() < deadline:
            time.sleep(0.5)
        assert read_lease(run_dir, storage).heartbeat_at > first + 20, said  # beating again, after the outage
        assert lease._thread.is_alive()
        assert all("renewing the lease failed (" in line and line.endswith("; retrying") for line in said), said
    finally:
        lease.release()
        proxy.close()


WATCHED_END = """
import sys, time
from rayllm.config import TrainConfig
from rayllm.loop.watchdog import HangWatchdog
config = TrainConfig()
config.run.dir = sys.argv[1]
config.train.hang_timeout_s = 0.3
dog = HangWatchdog(config, 0, 1, "here", 1, emit=lambda event: None)
dog.beat(1, 0.1)  # steps are 0.3 s apart at most from now on
with dog.slow(3.0, "the end of the run"):
    time.sleep(1.0)  # longer than a step may take, within the end's own deadline
print("survived", flush=True)
with dog.slow(0.5, "the end of the run"):
    time.sleep(300)  # past it: ended as a hang (its dump imports torch: seconds), naming the phase
"""


def test_the_end_of_the_run_has_its_own_deadline_in_the_watchdog(tmp_path):
    from rayllm.loop.watchdog import HANG_EXIT

    proc = subprocess.run(
        [sys.executable, "-c", WATCHED_END, str(tmp_path)], capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == HANG_EXIT, proc.stdout + proc.stderr
    assert "survived" in proc.stdout
    assert "the end of the run ran past its deadline" in proc.stderr, proc.stderr


def test_in_memory_checkpoints_over_the_object_store_are_refused_before_any_worker(
    corpus, tokenizer_file, tmp_path, tmp_path_factory
):
    temp_dir = tmp_path_factory.mktemp("rh")  # short: Ray's socket paths under it must stay < 108 bytes
    with ray_head(temp_dir, "--num-cpus=2", "--object-store-memory=100000000") as (gcs, env):
        cmd = cli_train_cmd(
            corpus,
            tokenizer_file,
            tmp_path / "run",
            "tracking.enabled=false",
            f"cluster.address={gcs}",
            "train.memory_checkpoint_every=2",
            "model.dim=512",  # about 8.9 M parameters: 12 bytes each, twice, over 100 MB
            "model.n_layers=2",
            "model.n_heads=8",
            "model.n_kv_heads=8",
        )
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_clear_error(proc, "in-memory checkpoints", "GiB of object store per node", "train.memory_checkpoint_every")


STALLED_KEEPER = """
import os, signal, sys, time
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
from ray.cluster_utils import Cluster
from rayllm.checkpoint import memory

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
try:
    other = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="ERROR")
    memory.register()
    memory.CALL_TIMEOUT_S = 3.0
    registry = memory.start_registry("rayllm-keepers-stall")
    neighbour = ray.get(registry.keeper.remote(other.node_id))
    pid = ray.get(neighbour.__ray_call__.remote(lambda self: os.getpid()))
    fs = memory.KeeperFileSystem()
    os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing: a keeper call times out
    fs.pipe_file("rayllm-keepers-stall/run/a", b"x" * 100)
    time.sleep(0.5)
    kept = other.node_id in ray.get(registry.keepers.remote())
    os.kill(pid, signal.SIGCONT)
    held = ray.get(neighbour.usage.remote(), timeout=30)  # it answers again, with what it held
    ray.kill(neighbour)  # now really dead: forgotten
    fs.pipe_file("rayllm-keepers-stall/run/b", b"y")
    time.sleep(0.5)
    forgotten = other.node_id not in ray.get(registry.keepers.remote())
    print("RESULT", kept, forgotten, held, flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_a_keeper_call_that_times_out_keeps_the_keeper_of_a_live_node(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STALLED_KEEPER)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert result[0].startswith("RESULT True True"), result[0]  # kept while stalled, forgotten once dead
