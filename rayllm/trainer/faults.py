"""Fault injection for the fault-tolerance tests, off unless an environment variable asks.

``RAYLLM_FAULT_CRASH_BEFORE_COMMIT=STEP`` makes the last rank exit abruptly after its shards of
the checkpoint of STEP are written and before that checkpoint is committed (first attempt
only): the crash that must leave resume on the previous complete checkpoint.
"""

from __future__ import annotations

import os

CRASH_BEFORE_COMMIT = "RAYLLM_FAULT_CRASH_BEFORE_COMMIT"
ENV_VARS = (CRASH_BEFORE_COMMIT,)


def maybe_crash_before_commit(step: int, rank: int, world_size: int, restarts: int) -> None:
    wanted = os.environ.get(CRASH_BEFORE_COMMIT)
    if wanted and int(wanted) == step and rank == world_size - 1 and restarts == 0:
        os._exit(17)
