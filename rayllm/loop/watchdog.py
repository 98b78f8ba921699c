"""Hang watchdog: a thread per rank that ends an attempt whose steps stopped, naming the rank.

A rank stuck in Python (a hung storage call, a dead lock, an injected sleep) leaves every
other rank blocked in its next collective, for ever under gloo and for NCCL's 10 minutes on
GPU. Each rank's watchdog notices that no step ended within the deadline

    deadline = train.hang_timeout_s, or max(train.hang_min_s, train.hang_factor x median step time)

(the long phases, start-up, validation and checkpoints, get SLOW_PHASE_S; the end of the run
gets its own deadline, train.close_timeout_s), and then:

1. posts where it is (running, in a collective, waiting for data) and how many collectives it
   has issued in each process group (torch's flight recorder keeps the count, for NCCL and gloo
   alike) to the process group's key-value store, which answers while the collectives hang;
2. writes its loop thread's and every other thread's Python stack to
   ``run.dir/hangs/attempt-N/rank-R.txt`` (with the NCCL flight recorder's collectives on GPU),
   after the post: object storage may be slow;
3. gathers the others' posts for GATHER_S: the ranks that issued fewer collectives in a group
   than its other members are the ones that did not reach the step's end. (On NCCL a collective
   returns at once and its rank waits later, in a read of a result, so where a rank's Python
   stands cannot tell; the counts can. Without counts, the ranks that are not in a collective
   or a data wait are the ones.) The lowest reporting rank writes the
   summary line (``hangs/attempt-N/summary.txt``) and sends it to the driver;
4. ends its process (HANG_EXIT), so the attempt fails and restarts from the latest checkpoint
   as any failure does.

Written by hand: torch's own timeouts (NCCL's watchdog, gloo's) end a collective, not a rank
stuck outside one, and name no culprit; NVRx's detector needs its own launcher.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator

from rayllm import events
from rayllm.config import TrainConfig
from rayllm.io.storage import join, write_text

HANG_EXIT = 75
SLOW_PHASE_S = 1800.0  # before the first step, and during validation and checkpoints
# The live ranks' watchdogs fire within about a step of each other: they wait in the same step's
# collectives, and their deadlines come from the same steps' times. Each posts before writing its
# dumps, so the others' posts are in within a few seconds; a rank that never posts (stopped, or
# hung outside Python) costs the whole window, which every hang's restart waits for.
GATHER_S = 3.0
FIRE_LIMIT_S = 120.0  # writing the dumps (object storage) and gathering may take this long, then the rank exits
SAMPLE_EVERY_S = 0.01  # the loop thread's stack is sampled this often: its time in collectives
RECENT_STEPS = 50
STORE_PREFIX = "rayllm-hang"
COLLECTIVE_FILES = ("distributed_c10d.py", "_fsdp_collectives.py", "_functional_collectives.py")


def step_deadline(config: TrainConfig, step_times: list[float]) -> float:
    """Seconds without a finished step after which a rank is hung (see the module docstring)."""
    t = config.train
    if t.hang_timeout_s is not None:
        return float(t.hang_timeout_s)
    if not step_times:
        return SLOW_PHASE_S
    return max(t.hang_min_s, t.hang_factor * statistics.median(step_times))


def in_collective(frame) -> bool:
    """Whether a thread's stack is inside a collective (a cheap walk: no source lines read)."""
    while frame is not None:
        if os.path.basename(frame.f_code.co_filename) in COLLECTIVE_FILES:
            return True
        frame = frame.f_back
    return False


def where(frame) -> tuple[str, str]:
    """(state, place) of a thread's stack: "collective" or "data" when it waits on another
    process, else "running", with the innermost frame that says so."""
    frames = traceback.extract_stack(frame)
    for f in reversed(frames):
        name = os.path.basename(f.filename)
        place = f"{f.name} ({name}:{f.lineno})"
        if name in COLLECTIVE_FILES:
            return "collective", place
        if f"{os.sep}rayllm{os.sep}data{os.sep}" in f.filename or name == "prefetch.py":
            return "data", place
    top = frames[-1] if frames else None
    return "running", f"{top.name} ({os.path.basename(top.filename)}:{top.lineno})" if top else "?"


def behind(reports: list[dict]) -> list[dict]:
    """The reports of ranks that issued fewer collectives in some process group than another member
    of it (the collective the others wait in is one it never reached); none when the counts agree."""
    by_rank = {r["rank"]: r for r in reports if r.get("issued")}
    late: set[int] = set()
    for report in by_rank.values():
        for group, ranks in report.get("groups", {}).items():
            counts = {m: by_rank[m]["issued"].get(group, -1) for m in ranks if m in by_rank}
            late.update(m for m, n in counts.items() if n < max(counts.values()))
    return [by_rank[m] for m in sorted(late)]


def summary_line(reports: list[dict], world_size: int, silent_s: float, deadline: float, where_to: str) -> str:
    """One line: how long nothing moved, who did not reach the step's end, where the stacks are."""
    culprits = behind(reports)
    culprits = (
        culprits or [r for r in reports if r["state"] == "running"] or [r for r in reports if r["state"] == "data"]
    )
    if not culprits:  # every reporting rank waits on another: the silent ones, else the lowest step
        missing = sorted(set(range(world_size)) - {r["rank"] for r in reports})
        culprits = [{"rank": m, "node": "?", "place": "no report", "step": "?"} for m in missing] or [
            r for r in reports if r["step"] == min(x["step"] for x in reports)
        ]
    named = "; ".join(f"rank {c['rank']} on node {c['node']} ({c['place']})" for c in culprits)
    waiting = sorted(r["rank"] for r in reports if r not in culprits)
    plural = "s" if len(waiting) > 1 else ""
    others = f"; rank{plural} {', '.join(map(str, waiting))} waited for it" if waiting else ""
    step = max((r["step"] for r in reports), default=0) + 1
    return (
        f"hang: no step finished for {silent_s:.0f} s (deadline {deadline:.0f} s): {named} did not reach the end "
        f"of step {step}{others}. Stacks in {where_to}"
    )


class HangWatchdog:
    """One per rank; ``beat`` at each step's end, ``slow`` around long phases. See the module docstring."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int, node: str, attempt: int, emit: Callable):
        self.config, self.rank, self.world_size, self.node, self.attempt = config, rank, world_size, node, attempt
        self._emit = emit
        self._loop_thread = threading.get_ident()  # Ray Train runs the loop in a thread of its own
        self._step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self._last_beat = time.monotonic()
        self._step = 0
        self._slow = 1  # in a long phase (start-up counts as one) while > 0
        self._phases: list[tuple[float, str]] = []  # long phases with a deadline of their own, innermost last
        self._samples = self._in_collectives = 0  # since collective_fraction was last asked
        self._window_start_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rayllm-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int, step_seconds: float) -> None:
        """A step ended (the loop thread)."""
        if self._slow:  # the first step ends the start-up phase
            self._slow = 0
        else:
            self._step_times.append(step_seconds)
        self._step, self._last_beat = step, time.monotonic()

    @contextlib.contextmanager
    def slow(self, seconds: float | None = None, phase: str | None = None) -> Iterator[None]:
        """A long phase (validation, a checkpoint): SLOW_PHASE_S, or ``seconds`` for a phase with
        a deadline of its own (named in the hang's line), and the clock restarts after it."""
        self._slow += 1
        if seconds is not None:
            self._phases.append((float(seconds), phase or "a long phase"))
        self._last_beat = time.monotonic()
        try:
            yield
        finally:
            if seconds is not None:
                self._phases.pop()
            self._slow -= 1
            self._last_beat = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def deadline(self) -> float:
        phases = self._phases[-1:]  # read once: the loop thread may leave the phase meanwhile
        if phases:
            return phases[0][0]
        return SLOW_PHASE_S if self._slow else step_deadline(self.config, list(self._step_times))

    def collective_fraction(self) -> float:
        """The part of the rank's time in collectives since the last call, which is its wait for the
        others: the straggler is the rank that waits least. On NCCL, the collectives' own GPU time
        from torch's flight recorder (a rank's Python returns from them at once); else the loop
        thread's stack, sampled."""
        samples, waiting = self._samples, self._in_collectives
        self._samples = self._in_collectives = 0
        now, since = time.time_ns(), self._window_start_ns
        self._window_start_ns = now
        on_gpu = nccl_wait_fraction(since, now)
        if on_gpu is not None:
            return on_gpu
        return waiting / samples if samples else 0.0

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            frame = sys._current_frames().get(self._loop_thread)
            self._samples += 1
            self._in_collectives += frame is not None and in_collective(frame)
            del frame
            silent = time.monotonic() - self._last_beat
            deadline = self.deadline()
            if silent > deadline:
                # The dumps go to storage that may itself be what hangs: the rank exits regardless.
                limit = threading.Timer(FIRE_LIMIT_S, os._exit, args=(HANG_EXIT,))
                limit.daemon = True
                limit.start()
                try:
                    self._fire(silent, deadline)
                finally:
                    os._exit(HANG_EXIT)

    def _fire(self, silent: float, deadline: float) -> None:
        folder = join(self.config.run.dir, "hangs", f"attempt-{self.attempt}")
        frame = sys._current_frames().get(self._loop_thread)
        state, place = where(frame) if frame is not None else ("running", "?")
        report = {"rank": self.rank, "node": self.node, "pid": os.getpid(), "step": self._step}
        report.update(state=state, place=place, **issued_collectives())
        gather = ReportGather(_store(), report, self.rank, self.world_size, f"{STORE_PREFIX}/{self.attempt}")
        header = json.dumps(report)
        write_text(join(folder, f"rank-{self.rank}.txt"), f"{header}\n\n{_all_stacks()}{_nccl_trace()}", self._storage)
        reports = gather.reports()
        line = summary_line(reports, self.world_size, silent, deadline, folder)
        phases = self._phases[-1:]
        if phases:  # not a step: a phase with its own deadline ran past it
            line = f"{phases[0][1]} ran past its deadline ({deadline:.0f} s); " + line
        if self.rank == min(r["rank"] for r in reports):
            write_text(join(folder, "summary.txt"), line + "\n", self._storage)
            print(f"[rayllm] {line}", file=sys.stderr, flush=True)
            self._emit(events.Failure(step=self._step, rank=self.rank, node=self.node, message=line))
            time.sleep(1.0)  # the record leaves before this process does
        else:
            time.sleep(2.0)  # the lowest rank may host the store; let it read before this one goes

    @property
    def _storage(self):
        return self.config.storage


class ReportGather:
    """The ranks' hang reports, through the process group's store: this rank's is posted at once and
    the others' are collected for ``within_s`` from then, in a thread. The store's server lives in
    rank 0's process, which may be the stopped or hung one: a store call may then never return, so
    the wait for the reports ends at the deadline regardless."""

    def __init__(self, store, report: dict, rank: int, world_size: int, prefix: str, within_s: float = GATHER_S):
        self._found = {rank: report}
        self._store, self._rank, self._world_size, self._prefix = store, rank, world_size, prefix
        self._until = time.monotonic() + within_s
        self._thread = None
        if store is not None and world_size > 1:
            self._thread = threading.Thread(target=self._collect, name="rayllm-hang-gather", daemon=True)
            self._thread.start()

    def reports(self) -> list[dict]:
        """Those in by the deadline, in rank order."""
        if self._thread is not None:
            self._thread.join(max(0.0, self._until - time.monotonic()) + 1.0)
        found = dict(self._found)
        return [found[r] for r in sorted(found)]

    def _collect(self) -> None:
        store, prefix = self._store, self._prefix
        try:
            store.set(f"{prefix}/{self._rank}", json.dumps(self._found[self._rank]))
            while len(self._found) < self._world_size and time.monotonic() < self._until:
                for r in range(self._world_size):
                    if r not in self._found and store.check([f"{prefix}/{r}"]):
                        self._found[r] = json.loads(store.get(f"{prefix}/{r}"))
                time.sleep(0.2)
        except Exception:  # the store's host is gone: say what this rank knows
            pass


def issued_collectives() -> dict[str, dict]:
    """{"issued": collectives this rank has issued, by process group name; "groups": each group's
    ranks}, from torch's flight recorder (its status is kept for every group, NCCL and gloo, even
    without a trace buffer); empty where there is none."""
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return {}
        status = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=False))["pg_status"]
        world = dist.distributed_c10d._world
        groups = {world.pg_names[pg]: dist.get_process_group_ranks(pg) for pg in list(world.pg_map)}
        issued = {name: int(s["last_enqueued_collective"]) for name, s in status.items() if name in groups}
        return {"issued": issued, "groups": {name: groups[name] for name in issued}}
    except Exception:  # a torch without it, or a group being torn down: the stacks still tell
        return {}


def wait_fraction(entries: list[dict], since_ns: int, now_ns: int) -> float | None:
    """The share of (since_ns, now_ns] that the flight recorder's timed collectives took (their
    GPU time, waiting for the peers included); None when none was timed (no NCCL timing). The
    recorder keeps its last entries only: a window longer than they cover counts what they cover."""
    timed = [e for e in entries if e.get("duration_ms") is not None and e.get("time_created_ns", 0) > since_ns]
    start = max(since_ns, min((e.get("time_created_ns", 0) for e in entries), default=since_ns))
    if not timed or now_ns <= start:
        return None
    return min(1.0, sum(float(e["duration_ms"]) for e in timed) * 1e6 / (now_ns - start))


def nccl_wait_fraction(since_ns: int, now_ns: int) -> float | None:
    """wait_fraction of this process's NCCL collectives (TORCH_NCCL_ENABLE_TIMING, set for GPU
    ranks by rayllm.parallel.process_group); None off NCCL."""
    try:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(onlyActive=False)).get("entries", [])
        return wait_fraction(entries, since_ns, now_ns)
    except Exception:
        return None


def _store():
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


def _all_stacks() -> str:
    """Every thread's Python stack, as faulthandler writes it (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _nccl_trace() -> str:
    """The NCCL flight recorder's entries (collectives in flight), where there is one."""
    try:
        import pickle

        import torch

        if not torch.cuda.is_available():
            return ""
        entries = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
        return "\n\nNCCL flight recorder:\n" + json.dumps(entries, default=str, indent=1)[:2_000_000]
    except Exception as e:
        return f"\n\nNCCL flight recorder: unavailable ({type(e).__name__})"
