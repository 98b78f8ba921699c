"""Fault injection for the fault-tolerance tests, off unless an environment variable asks.

``RAYLLM_FAULT_CRASH_BEFORE_COMMIT=STEP:MARKER`` makes the last rank exit abruptly after its
shards of the checkpoint of STEP are written and before that checkpoint is committed: the
crash that must leave resume on the previous complete checkpoint. It fires once: it creates
the file MARKER, and does nothing while that file exists.

``RAYLLM_FAULT_PAUSE_AT=STEP:MARKER`` makes every rank wait before training step STEP for as
long as the file MARKER exists: a test holds a run there until something it waits for (a
node added, a resize) has happened, however fast or slow the machine is.
"""

from __future__ import annotations

import os
import time

CRASH_BEFORE_COMMIT = "RAYLLM_FAULT_CRASH_BEFORE_COMMIT"
PAUSE_AT = "RAYLLM_FAULT_PAUSE_AT"
ENV_VARS = (CRASH_BEFORE_COMMIT, PAUSE_AT)


def maybe_crash_before_commit(step: int, rank: int, world_size: int) -> None:
    wanted = os.environ.get(CRASH_BEFORE_COMMIT)
    if not wanted or rank != world_size - 1:
        return
    at, marker = wanted.split(":", 1)
    if int(at) == step and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"crashed before the commit of step {step}\n")
        os._exit(17)


def maybe_pause_before(step: int) -> None:
    wanted = os.environ.get(PAUSE_AT)
    if not wanted:
        return
    at, marker = wanted.split(":", 1)
    while int(at) == step and os.path.exists(marker):
        time.sleep(0.1)
