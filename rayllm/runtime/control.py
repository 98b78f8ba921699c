"""The run's control actor: lives on the driver's node for the whole run, across attempts.

It holds what must outlive a worker group: the stop flag the driver sets on SIGTERM/SIGINT
(rank 0 reads it between steps), the attempt count, the nodes' data relays (data/stream/relay.py;
owned here, not by the stream server, so a dead server does not take them along and a lost
relay is told apart from a lost server), each training node's interruption watcher
(interruption.py), and the failures seen so far, so that an
error that repeats at the same step on a fresh attempt is recognised as deterministic and ends
the run with its message instead of being retried up to ``cluster.max_failures`` (for ever
with -1).

It also counts the attempts that end without a new checkpoint: a process that dies hard (a
segfault, an out-of-memory kill, the hang watchdog's exit) never reaches the failure record, and
under ``cluster.max_failures: -1`` would be restarted for ever at the same step. Rank 0 reports
each step and each commit here (``progress``); the next attempt's ``begin_attempt`` ends the run,
naming the step, once ``cluster.max_attempts_without_progress`` attempts in a row made none.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from rayllm.data.stream.relay import node_relay
from rayllm.io.retry import describe, is_transient, root_causes
from rayllm.ray_cluster import pinned_actor
from rayllm.runtime.interruption import NodeInterruptionWatcher, WatchSettings

# A collective's error on a rank whose peer died: the peer's failure, not this rank's own.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


@dataclass(frozen=True)
class FailureRecord:
    """What identifies a rank's failure across attempts: where in the attempt, and the root cause."""

    where: str  # "at step 7" (7 steps done, in the step loop) or "while starting (restore, data, setup)"
    cause: str  # the root cause(s), type and first line: DCP's per-rank errors unwrapped
    transient: bool  # storage or network (rayllm.io.retry): never "the same failure", the attempt restarts
    peer_lost: bool  # a collective whose peer died: that peer's failure, counted by the progress rule

    @property
    def repeatable(self) -> bool:
        return not (self.transient or self.peer_lost)


def failure_record(error: BaseException, steps_done: int, in_loop: bool) -> FailureRecord:
    """``in_loop``: the attempt's step loop had begun (its data stream was open), so the failure
    happened in step ``steps_done + 1``, after the resume step; else while the attempt started,
    which no earlier step's failure is the same as."""
    causes = list(dict.fromkeys(describe(root) for root in root_causes(error)))
    cause = "; ".join(causes)[:600]
    where = f"at step {steps_done}" if in_loop else "while starting (restore, data, setup)"
    return FailureRecord(where, cause, is_transient(error), any(p in cause for p in PEER_LOST))


@dataclass
class AttemptProgress:
    """What rank 0 reported of one attempt."""

    started_at: int | None = None  # the step it resumed from
    last_step: int | None = None  # the latest step it reported
    committed: bool = False  # a checkpoint (stored or in memory) was committed during it
    outage: bool = False  # it ended with a transient storage error (a rank's or the controller's): not a crash loop
    world_size: int | None = None  # its workers: an attempt followed by a larger one ended to grow
    cause: str | None = None  # the first failure a rank recorded for it


class RunControl:
    """A Ray actor (num_cpus=0, pinned to the driver's node); see the module docstring."""

    def __init__(self):
        self._stop = False
        self._attempt = 0
        self._failures: dict[tuple[str, str], int] = {}  # (where, cause) -> first attempt seen
        self._progress: dict[int, AttemptProgress] = {}  # attempt -> what rank 0 reported of it
        self._relays: dict[str, object] = {}  # node id -> its data relay
        self._run = uuid.uuid4().hex[:12]  # names this run's relays
        self._peak_flops: dict[int, float] = {}  # world size -> every rank's matmul peak, summed
        self._watchers: dict[str, object] = {}  # node id -> its interruption watcher

    def peak_flops(self, world_size: int) -> float | None:
        return self._peak_flops.get(world_size)

    def remember_peak_flops(self, world_size: int, flops: float) -> None:
        self._peak_flops[world_size] = flops

    def relay(self, node: str, server):
        """``node``'s data relay for ``server``: created on the first ask, then the same one at every
        attempt, attached to the server at each ask (a relay Ray restarted comes back without it; its
        ranks' calls, which come after this one, wait for it)."""
        if node not in self._relays:
            self._relays[node] = node_relay(f"rayllm-{self._run}", node)
        self._relays[node].attach.remote(server)
        return self._relays[node]

    def watch_node(self, node: str, settings: WatchSettings) -> None:
        """Start ``node``'s interruption watcher on the first ask (a training worker's, at each
        attempt); it lives as long as the run, or its node."""
        if node not in self._watchers:
            self._watchers[node] = pinned_actor(NodeInterruptionWatcher, node).remote(settings)

    def request_stop(self) -> None:
        self._stop = True

    def stop_requested(self) -> bool:
        return self._stop

    def begin_attempt(self, max_without_progress: int | None = None, world_size: int | None = None) -> AttemptStart:
        """Rank 0, once per attempt, before any other rank asks ``attempt``: its number, and why the
        run must stop instead when the last ``max_without_progress`` attempts made no progress."""
        self._attempt += 1
        self._progress[self._attempt] = AttemptProgress(world_size=world_size)
        return AttemptStart(self._attempt, self._crash_loop(max_without_progress))

    def attempt_hit_outage(self) -> None:
        """Ray Train's controller (its failure policy): the current attempt ended on a storage outage."""
        self._progress.setdefault(self._attempt, AttemptProgress()).outage = True

    def attempt(self) -> int:
        return self._attempt

    def progress(self, attempt: int, step: int, committed: bool = False, start: bool = False) -> None:
        """Rank 0: ``attempt`` reached ``step`` (started there, or committed a checkpoint at it)."""
        seen = self._progress.setdefault(attempt, AttemptProgress())
        if start and seen.started_at is None:
            seen.started_at = step
        seen.last_step = step if seen.last_step is None else max(seen.last_step, step)
        seen.committed = seen.committed or committed

    def record_failure(self, attempt: int, record: FailureRecord) -> bool:
        """Record a rank's failure; True when an earlier attempt failed the same way at the same
        place (a deterministic error). Transient errors and a peer's loss never repeat this way."""
        seen = self._progress.setdefault(attempt, AttemptProgress())
        seen.outage = seen.outage or record.transient
        if seen.cause is None and not record.peer_lost:
            seen.cause = record.cause
        if not record.repeatable:
            return False
        first = self._failures.setdefault((record.where, record.cause), attempt)
        return first < attempt

    def _crash_loop(self, limit: int | None) -> str | None:
        """Why the run must stop: the attempts before this one that ended without a new checkpoint,
        in a row. Passed over: those a storage outage ended (retried, not counted) and those ended
        to grow (the next attempt has more workers: nodes arrived, as on a cluster scaling up)."""
        if not limit:
            return None
        stalled: list[AttemptProgress] = []
        for attempt in range(self._attempt - 1, 0, -1):
            seen = self._progress.get(attempt, AttemptProgress())
            if seen.committed:
                break
            after = self._progress.get(attempt + 1, AttemptProgress()).world_size
            grew = None not in (seen.world_size, after) and after > seen.world_size
            if not seen.outage and not grew:
                stalled.append(seen)
        if len(stalled) < limit:
            return None
        stalled = stalled[:limit][::-1]
        steps = sorted({s.last_step for s in stalled if s.last_step is not None})
        if not steps:
            where = "each before its first step"
        elif len(steps) == 1:
            where = f"each at step {steps[0]}"
        else:
            where = f"at steps {', '.join(map(str, steps))}"
        causes = list(dict.fromkeys(s.cause for s in stalled if s.cause))
        why = f"the last error: {causes[-1]}" if causes else "no error was recorded: the process was killed"
        return (
            f"{len(stalled)} attempts in a row ended without a new checkpoint, {where} ({why}); a "
            "crash there (a segfault, an out-of-memory kill, a hang) repeats on every restart. Fix its cause "
            "(the workers' logs name it), or raise cluster.max_attempts_without_progress"
        )


@dataclass(frozen=True)
class AttemptStart:
    """``RunControl.begin_attempt``'s answer."""

    attempt: int
    stop: str | None = None  # set: the run must end with this message (a crash loop)
