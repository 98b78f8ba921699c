"""Python's cyclic garbage collector, run at steps the loop chooses instead of whenever
allocations trigger it: a collection in the middle of one rank's step delays every rank at the
next collective, at a different step each time (torchtitan collects every 50 steps too)."""

from __future__ import annotations

import gc

YOUNG_EVERY_STEPS = 50  # generations 0 and 1: the step's own short-lived cycles
FULL_EVERY_STEPS = 1000  # every generation: what survived long enough to reach the oldest


class GarbageSchedule:
    """``with GarbageSchedule() as collector:`` the automatic collector is off, and
    ``collector.after_step(step)`` collects on schedule; on exit it is as it was."""

    def __enter__(self) -> GarbageSchedule:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()  # what start-up left, before the first step
        return self

    def after_step(self, step: int) -> None:
        if step % FULL_EVERY_STEPS == 0:
            gc.collect()
        elif step % YOUNG_EVERY_STEPS == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self._was_enabled:
            gc.enable()
