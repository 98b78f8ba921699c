"""Stragglers: ranks persistently slower than the median, named with their node.

In synchronous training every rank's step takes the same wall time: the fast ranks wait for
the slow one in the collectives. What tells them apart is each rank's own time, the step
less its data wait and less its time in collectives (the hang watchdog samples the loop's
stack every 10 ms; the straggler is the rank that waits least). A rank whose
own time is above ``train.straggler_factor`` x the median (and at least MIN_EXCESS_S above
it, so noise on steps of milliseconds is not a straggler) in ``train.straggler_windows`` log
windows in a row is named on the progress line and in metrics.jsonl.
"""

from __future__ import annotations

import statistics

MIN_EXCESS_S = 0.05  # below this, a rank's excess is noise (seen: 4 ranks on 2 cores, rank 0 at 3x of 10 ms)


class Stragglers:
    """Fed each log window's per-rank own step times (the driver's monitor)."""

    def __init__(self, factor: float, windows: int):
        self.factor, self.windows = factor, max(1, windows)
        self._slow_in_row: dict[int, int] = {}

    def update(self, own_times: list[float]) -> dict[int, float]:
        """{rank: its own time / the median} for the ranks slow for ``windows`` windows in a row."""
        if len(own_times) < 2:
            return {}
        median = statistics.median(own_times)
        named = {}
        for rank, own in enumerate(own_times):
            slow = own > self.factor * median and own - median >= MIN_EXCESS_S
            self._slow_in_row[rank] = self._slow_in_row.get(rank, 0) + 1 if slow else 0
            if self._slow_in_row[rank] >= self.windows:
                named[rank] = own / median if median > 0 else float("inf")
        return named

    def reset(self) -> None:
        """A new attempt: ranks may be other processes on other nodes."""
        self._slow_in_row.clear()
