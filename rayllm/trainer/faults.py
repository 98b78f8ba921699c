"""Fault injection for the fault-tolerance tests, off unless an environment variable asks.

``RAYLLM_FAULT_CRASH_BEFORE_COMMIT=STEP:MARKER`` makes the last rank exit abruptly after its
shards of the checkpoint of STEP are written and before that checkpoint is committed: the
crash that must leave resume on the previous complete checkpoint. It fires once: it creates
the file MARKER, and does nothing while that file exists.
"""

from __future__ import annotations

import os

CRASH_BEFORE_COMMIT = "RAYLLM_FAULT_CRASH_BEFORE_COMMIT"
ENV_VARS = (CRASH_BEFORE_COMMIT,)


def maybe_crash_before_commit(step: int, rank: int, world_size: int) -> None:
    wanted = os.environ.get(CRASH_BEFORE_COMMIT)
    if not wanted or rank != world_size - 1:
        return
    at, marker = wanted.split(":", 1)
    if int(at) == step and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"crashed before the commit of step {step}\n")
        os._exit(17)
