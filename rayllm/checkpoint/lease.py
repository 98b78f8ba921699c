"""A run owns its run.dir: a lease file with an owner id and a heartbeat, refused to a second run.

Two runs on one run.dir (a job resubmitted while the first still runs) write the same checkpoint
names: one run's marker could cover the other's half-written files, retention would delete the
other's folders, and metrics.jsonl and config.yaml would interleave. So the driver (or rank 0
under torchrun) takes ``<run.dir>/rayllm_lease.json`` before anything starts and renews its
heartbeat from a daemon thread; a second run finding a live heartbeat is refused with one line,
and a lease whose heartbeat is older than its timeout (its owner is gone: the driver was killed)
is taken over, saying so; on the same host a lease whose process is gone is taken over at once
(a run killed and started again, a torchrun rank 0 ended by the hang watchdog's ``os._exit``).
A run that finds its lease taken (it was silent past the timeout: paused, cut off from storage)
stops: its renewal asks for a stop (``on_lost``), and rank 0 checks the owner before writing a
checkpoint and before committing one (``require_owner``), so it never writes over the new owner's.
Under torchrun the owner is the torchrun job (its agent process), so that the job's own
restarts keep the lease.

Written by hand over the run dir's own fsspec filesystem because it must work where the
checkpoints live, on object storage too, which has no file locks: a taker writes the lease and
reads it back after a short settle, so of two takers the later write wins and the other sees
the winner's id and is refused; every renewal checks the id again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable

from rayllm.checkpoint.store import put_small_file
from rayllm.errors import RayllmError
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem

LEASE_FILE = "rayllm_lease.json"
SETTLE_S = 1.0  # between writing the lease and reading it back (capped at a tenth of the timeout)


class RunDirTaken(RayllmError):
    """Another live run owns the run dir."""


@dataclasses.dataclass(frozen=True)
class LeaseOwner:
    """Who holds a run dir: a random id, and where and since when, for the refusal's line."""

    id: str
    host: str
    pid: int
    started_at: float

    @classmethod
    def this_process(cls) -> LeaseOwner:
        """This process, or under torchrun its agent (the ranks' parent), whose restarts are the same run."""
        host = socket.gethostname()
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id is None:
            return cls(uuid.uuid4().hex[:16], host, os.getpid(), time.time())
        agent = os.getppid()
        job = uuid.uuid5(uuid.NAMESPACE_URL, f"torchrun://{host}/{agent}/{run_id}/{_proc_stat(agent)[19:20]}").hex[:16]
        return cls(job, host, agent, time.time())

    def gone(self) -> bool:
        """Whether this owner's process is known to be gone: only on this host (else: the heartbeat)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return _proc_stat(self.pid)[:1] == ["Z"]  # a zombie: ended, not yet reaped

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at))
        return f"run {self.id} on {self.host}, pid {self.pid}, since {since}"


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """The lease file's content."""

    owner: LeaseOwner
    heartbeat_at: float
    timeout_s: float

    def to_json(self) -> dict:
        return {"owner": dataclasses.asdict(self.owner), "heartbeat_at": self.heartbeat_at, "timeout_s": self.timeout_s}

    @classmethod
    def from_json(cls, raw: dict) -> LeaseRecord:
        return cls(LeaseOwner(**raw["owner"]), float(raw["heartbeat_at"]), float(raw["timeout_s"]))


def _proc_stat(pid: int) -> list[str]:
    """A process's /proc/PID/stat fields from its state on (Linux); [] where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def read_lease(run_dir: str, storage: StorageSettings) -> LeaseRecord | None:
    """The run dir's lease, or None (none, or unreadable: a half-written lease owns nothing)."""
    fs, root = filesystem(run_dir, storage)
    try:
        return LeaseRecord.from_json(json.loads(fs.cat_file(posixpath.join(root, LEASE_FILE))))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def lease_owner_id(run_dir: str, storage: StorageSettings) -> str | None:
    """The id of the run holding the run dir now (written into each commit marker)."""
    record = read_lease(run_dir, storage)
    return record.owner.id if record else None


def require_owner(run_dir: str, storage: StorageSettings, owner_id: str, doing: str) -> None:
    """Raise RunDirTaken, naming the new owner, unless the run dir's lease is still ``owner_id``'s
    (a missing lease is still ours: the renewal writes it back)."""
    record = read_lease(run_dir, storage)
    if record is not None and record.owner.id != owner_id:
        raise RunDirTaken(
            f"run.dir {run_dir} was taken over by {record.owner.describe()} while this run (run {owner_id}) "
            f"was silent for longer than run.lease_timeout_s; stopping without {doing}: the run dir is that "
            "run's now. Resume this one in another run.dir, or stop the other run and start this one again"
        )


class RunDirLease:
    """One run's hold on its run dir: ``acquire`` before anything starts, ``release`` at the end."""

    def __init__(self, run_dir: str, storage: StorageSettings, timeout_s: float, log: Callable[[str], None] = print):
        self.run_dir, self.storage, self.timeout_s, self.log = run_dir, storage, timeout_s, log
        self.fs, self.root = filesystem(run_dir, storage)
        self.path = posixpath.join(self.root, LEASE_FILE)
        self.owner = LeaseOwner.this_process()
        self.lost = threading.Event()  # set when a renewal found another owner's id
        # Called once, from the renewal thread, when the lease was found taken: stop the run.
        self.on_lost: Callable[[LeaseRecord], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, or raise RunDirTaken naming the live owner and the fix."""
        current = read_lease(self.run_dir, self.storage)
        if current is not None and current.owner.id != self.owner.id:
            age = time.time() - current.heartbeat_at
            gone = current.owner.gone()
            if age < current.timeout_s and not gone:
                raise self._taken(current, age)
            why = "its process is gone" if gone else f"no heartbeat for {age:.0f} s (run.lease_timeout_s "
            why += "" if gone else f"{current.timeout_s:g}), so that run is gone"
            self.log(f"run.dir {self.run_dir}: taking over the lease of {current.owner.describe()}: {why}")
        self._write()
        time.sleep(min(SETTLE_S, self.timeout_s / 10))
        back = read_lease(self.run_dir, self.storage)
        if back is None or back.owner.id != self.owner.id:  # another taker wrote after us: it wins
            raise self._taken(back, 0.0) if back else RunDirTaken(f"run.dir {self.run_dir}: the lease vanished")
        self._thread = threading.Thread(target=self._renew, name="rayllm-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lease, if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            current = read_lease(self.run_dir, self.storage)
            if current is not None and current.owner.id == self.owner.id:
                self.fs.rm_file(self.path)
        except Exception as e:  # noqa: BLE001 - storage away at the very end: the lease expires on its own
            self.log(f"run.dir {self.run_dir}: could not remove the lease ({type(e).__name__}); it expires by itself")

    def _taken(self, current: LeaseRecord, age: float) -> RunDirTaken:
        return RunDirTaken(
            f"run.dir {self.run_dir} is in use by {current.owner.describe()} (its heartbeat is {age:.0f} s old, "
            f"live for {current.timeout_s:g} s): stop that run first, or give this one another run.dir"
        )

    def _write(self) -> None:
        record = LeaseRecord(self.owner, time.time(), self.timeout_s)
        self.fs.makedirs(self.root, exist_ok=True)
        # Whole or not at all: a taker reading back mid-write must see a lease, not an empty file.
        put_small_file(self.fs, self.path, json.dumps(record.to_json()).encode())

    def _renew(self) -> None:
        """Every quarter of the timeout: check the lease is still ours, then renew the heartbeat.
        A storage error is retried at the next beat (the lease lives a whole timeout)."""
        while not self._stop.wait(self.timeout_s / 4):
            try:
                current = read_lease(self.run_dir, self.storage)
                if current is not None and current.owner.id != self.owner.id:
                    self.lost.set()
                    self.log(
                        f"run.dir {self.run_dir}: the lease was taken over by {current.owner.describe()}; "
                        "stopping this run without writing another checkpoint"
                    )
                    if self.on_lost is not None:
                        self.on_lost(current)
                    return
                self._write()
            except Exception as e:  # noqa: BLE001 - any failure to renew (an outage past the retry deadline, an
                # error the storage client raises as its own type): the next beat tries again, as the thread
                # must outlive it; a lease not renewed for a whole timeout is another run's to take, and this run
                # then stops at its next checkpoint (require_owner).
                self.log(f"run.dir {self.run_dir}: renewing the lease failed ({type(e).__name__}); retrying")
