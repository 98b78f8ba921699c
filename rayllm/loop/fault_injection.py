"""Fault injection for the fault-tolerance tests, off unless an environment variable asks.

``RAYLLM_FAULT_CRASH_BEFORE_COMMIT=STEP:MARKER`` makes the last rank exit abruptly after its
shards of the checkpoint of STEP are written and before that checkpoint is committed: the
crash that must leave resume on the previous complete checkpoint. It fires once: it creates
the file MARKER, and does nothing while that file exists. STEP 0 means any step: a test arms it
by removing MARKER, and the next commit crashes (the same for RAYLLM_FAULT_HANG_AT).

``RAYLLM_FAULT_PAUSE_AT=STEP:MARKER`` makes every rank wait before training step STEP for as
long as the file MARKER exists: a test holds a run there until something it waits for (a
node added, a resize) has happened, however fast or slow the machine is. Several holds are
separated by commas; STEP 0 holds before any step while MARKER exists.

``RAYLLM_FAULT_NAN_FROM=STEP`` makes the loss NaN from step STEP on (divergence).

``RAYLLM_FAULT_RAISE_AT=STEP`` makes rank 0 raise the same ValueError in step STEP on every
attempt: an error no restart fixes.

``RAYLLM_FAULT_HANG_AT=STEP:RANK:MARKER`` makes rank RANK sleep for an hour inside step STEP
(after its backward, before the gradient norm's all-reduce): a hung rank, which the hang
watchdog must name. It fires once: it creates the file MARKER, and does nothing while it exists.

``RAYLLM_FAULT_SLOW_STEP=RANK:SECONDS`` makes rank RANK's every step SECONDS longer (in its
own compute): a straggler, which the progress line must name.

``RAYLLM_FAULT_SLOW_DATA=RANK:SECONDS`` makes rank RANK's every wait for data SECONDS longer:
a starved rank, which the logged data wait must name.
"""

from __future__ import annotations

import os
import time

CRASH_BEFORE_COMMIT = "RAYLLM_FAULT_CRASH_BEFORE_COMMIT"
PAUSE_AT = "RAYLLM_FAULT_PAUSE_AT"
NAN_FROM = "RAYLLM_FAULT_NAN_FROM"
RAISE_AT = "RAYLLM_FAULT_RAISE_AT"
SLOW_DATA = "RAYLLM_FAULT_SLOW_DATA"
HANG_AT = "RAYLLM_FAULT_HANG_AT"
SLOW_STEP = "RAYLLM_FAULT_SLOW_STEP"
ENV_VARS = (CRASH_BEFORE_COMMIT, PAUSE_AT, NAN_FROM, RAISE_AT, SLOW_DATA, HANG_AT, SLOW_STEP)


def maybe_crash_before_commit(step: int, rank: int, world_size: int) -> None:
    wanted = os.environ.get(CRASH_BEFORE_COMMIT)
    if not wanted or rank != world_size - 1:
        return
    at, marker = wanted.split(":", 1)
    if int(at) in (0, step) and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"crashed before the commit of step {step}\n")
        os._exit(17)


def maybe_pause_before(step: int) -> None:
    wanted = os.environ.get(PAUSE_AT)
    if not wanted:
        return
    for hold in wanted.split(","):
        at, marker = hold.split(":", 1)
        while int(at) in (0, step) and os.path.exists(marker):
            time.sleep(0.1)


def loss_scale(step: int) -> float:
    """1.0, or NaN from RAYLLM_FAULT_NAN_FROM's step on."""
    wanted = os.environ.get(NAN_FROM)
    return float("nan") if wanted and step >= int(wanted) else 1.0


def maybe_raise_at(step: int, rank: int) -> None:
    wanted = os.environ.get(RAISE_AT)
    if wanted and rank == 0 and step == int(wanted):
        raise ValueError(f"injected deterministic failure in step {step}")


def maybe_slow_data(rank: int) -> None:
    wanted = os.environ.get(SLOW_DATA)
    if wanted:
        slow_rank, seconds = wanted.split(":", 1)
        if int(slow_rank) == rank:
            time.sleep(float(seconds))


def maybe_hang(step: int, rank: int) -> None:
    """A hung rank (RAYLLM_FAULT_HANG_AT), then a slow one (RAYLLM_FAULT_SLOW_STEP), inside a step."""
    hang = os.environ.get(HANG_AT)
    if hang:
        at, who, marker = hang.split(":", 2)
        if int(at) in (0, step) and int(who) == rank and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(f"rank {rank} hung in step {step}\n")
            time.sleep(3600)
    slow = os.environ.get(SLOW_STEP)
    if slow:
        who, seconds = slow.split(":", 1)
        if int(who) == rank:
            time.sleep(float(seconds))
