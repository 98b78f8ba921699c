"""A run owns its run.dir (checkpoint/lease.py): a second live run is refused with one line, a
silent lease is taken over, two takers at once leave exactly one owner."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from rayllm.checkpoint.lease import LEASE_FILE, LeaseOwner, LeaseRecord, RunDirLease, RunDirTaken, read_lease
from rayllm.io.settings import StorageSettings

STORAGE = StorageSettings()


def test_a_second_run_on_a_live_run_dir_is_refused_naming_the_owner(tmp_path):
    first = RunDirLease(str(tmp_path), STORAGE, timeout_s=5.0, log=print)
    first.acquire()
    try:
        with pytest.raises(RunDirTaken) as refused:
            RunDirLease(str(tmp_path), STORAGE, timeout_s=5.0).acquire()
        line = str(refused.value)
        assert "\n" not in line
        for needle in (str(tmp_path), socket.gethostname(), f"pid {os.getpid()}", "since", "another run.dir"):
            assert needle in line, line
        assert read_lease(str(tmp_path), STORAGE).owner == first.owner  # the refused run wrote nothing
    finally:
        first.release()
    assert not (tmp_path / LEASE_FILE).exists()  # released at the end: the next run starts
    RunDirLease(str(tmp_path), STORAGE, timeout_s=5.0).acquire()


def test_a_lease_without_a_heartbeat_is_taken_over_saying_so(tmp_path):
    gone = LeaseOwner("deadbeef", "old-host", 4242, time.time() - 600)
    stale = LeaseRecord(gone, heartbeat_at=time.time() - 120, timeout_s=60.0)
    (tmp_path / LEASE_FILE).write_text(json.dumps(stale.to_json()))
    said: list[str] = []
    lease = RunDirLease(str(tmp_path), STORAGE, timeout_s=5.0, log=said.append)
    lease.acquire()
    try:
        assert len(said) == 1 and "taking over" in said[0] and "old-host, pid 4242" in said[0], said
        assert read_lease(str(tmp_path), STORAGE).owner == lease.owner
    finally:
        lease.release()


def test_a_fresh_lease_whose_process_on_this_host_is_gone_is_taken_over_at_once(tmp_path):
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # a driver killed a moment ago: its heartbeat is fresh, its process gone
    dead = LeaseRecord(LeaseOwner("killed", socket.gethostname(), ended.pid, time.time()), time.time(), 60.0)
    (tmp_path / LEASE_FILE).write_text(json.dumps(dead.to_json()))
    said: list[str] = []
    lease = RunDirLease(str(tmp_path), STORAGE, timeout_s=5.0, log=said.append)
    lease.acquire()
    lease.release()
    assert len(said) == 1 and "run killed" in said[0] and "its process is gone" in said[0], said


def test_the_heartbeat_is_renewed_while_the_run_lives(tmp_path):
    lease = RunDirLease(str(tmp_path), STORAGE, timeout_s=0.4)
    lease.acquire()
    try:
        first = read_lease(str(tmp_path), STORAGE).heartbeat_at
        time.sleep(0.6)  # past the timeout: a lease not renewed would now be taken over
        assert read_lease(str(tmp_path), STORAGE).heartbeat_at > first
        with pytest.raises(RunDirTaken):
            RunDirLease(str(tmp_path), STORAGE, timeout_s=0.4).acquire()
    finally:
        lease.release()


def test_of_two_runs_taking_the_lease_at_once_exactly_one_owns_it(tmp_path):
    leases = [RunDirLease(str(tmp_path), STORAGE, timeout_s=5.0) for _ in range(2)]
    won: list[RunDirLease] = []
    refused: list[str] = []
    start = threading.Barrier(2)

    def take(lease: RunDirLease) -> None:
        start.wait()
        try:
            lease.acquire()
            won.append(lease)
        except RunDirTaken as e:
            refused.append(str(e))

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert len(won) == 1 and len(refused) == 1, (won, refused)
        assert read_lease(str(tmp_path), STORAGE).owner == won[0].owner
    finally:
        for lease in won:
            lease.release()


def test_a_run_whose_lease_was_taken_over_is_told_and_may_not_write(tmp_path):
    """A lease overwritten by another owner (the first run was silent past its timeout): the
    renewal calls on_lost with the new owner, and require_owner refuses, naming it."""
    from rayllm.checkpoint.lease import require_owner

    lease = RunDirLease(str(tmp_path), STORAGE, timeout_s=0.4)
    told = threading.Event()
    seen: list[LeaseRecord] = []
    lease.on_lost = lambda record: (seen.append(record), told.set())
    lease.acquire()
    require_owner(str(tmp_path), STORAGE, lease.owner.id, "writing")  # still ours: no error
    other = LeaseRecord(LeaseOwner("other-run", "elsewhere", 4242, time.time()), time.time(), 60.0)
    (tmp_path / LEASE_FILE).write_text(json.dumps(other.to_json()))
    try:
        assert told.wait(2.0) and seen[0].owner.id == "other-run" and lease.lost.is_set()
        with pytest.raises(RunDirTaken, match="was taken over by run other-run on elsewhere, pid 4242"):
            require_owner(str(tmp_path), STORAGE, lease.owner.id, "committing the checkpoint of step 8")
    finally:
        lease.release()
    assert read_lease(str(tmp_path), STORAGE).owner.id == "other-run", "release leaves another's lease"
