"""What ``rayllm bench goodput`` reports, read from the two runs' records: the ratio, each fault's
cost, and where each run's wall time went (start-up, steps, the steps a fault interrupted, the end).

The split answers the question the ratio leaves open: whether the faulted run lost its time to
the faults themselves or to something else (slower steps between them, a slower start or end).
"""

from __future__ import annotations

import dataclasses
import io
import posixpath
import statistics
from collections import Counter

from rayllm.bench.common import read_records
from rayllm.config import TrainConfig


@dataclasses.dataclass
class Fault:
    kind: str
    at: float  # wall clock
    step: int = 0  # the latest step logged before it (the driver stamps each record as it comes)
    next_step_s: float | None = None  # to the next completed step
    past_s: float | None = None  # to the first step beyond ``step``


@dataclasses.dataclass(frozen=True)
class TimeSplit:
    """A run's wall time in four parts that add up to it."""

    to_first_step_s: float  # the driver's start to the first completed step
    stepping_s: float  # between completed steps, where no fault fell
    faulted_s: float  # between the completed steps that a fault fell between
    to_end_s: float  # the last completed step to the driver's return
    step_s: float  # the median time between steps where no fault fell

    @classmethod
    def of(cls, started: float, ended: float, step_times: list[float], faults_at: list[float]) -> TimeSplit:
        """``step_times``: when each train record arrived, in order; ``faults_at``: when each fault came."""
        if not step_times:
            return cls(ended - started, 0.0, 0.0, 0.0, 0.0)
        clean, hit = [], 0.0
        for before, after in zip(step_times, step_times[1:], strict=False):
            if any(before < at <= after for at in faults_at):
                hit += after - before
            else:
                clean.append(after - before)
        median = statistics.median(clean) if clean else 0.0
        return cls(step_times[0] - started, sum(clean), hit, ended - step_times[-1], median)


@dataclasses.dataclass
class RunFigures:
    wall_s: float
    loss: float | None
    steps: int
    steps_repeated: int
    attempts: int
    ids: Counter
    split: TimeSplit


@dataclasses.dataclass
class Report:
    undisturbed: RunFigures
    faulted: RunFigures
    faults: list[Fault]

    @property
    def ratio(self) -> float:
        return self.undisturbed.wall_s / self.faulted.wall_s

    @property
    def exactly_once(self) -> bool:
        return bool(self.undisturbed.ids) and self.undisturbed.ids == self.faulted.ids

    @property
    def loss_rel_diff(self) -> float:
        a, b = self.undisturbed.loss, self.faulted.loss
        return abs(a - b) / abs(a) if a and b is not None else float("nan")


def committed_ids(config: TrainConfig) -> list[tuple[int, ...]]:
    """Every sequence id that the run's committed checkpoints record as trained on (data.record_ids:
    each stored checkpoint holds those trained since the one before)."""
    import numpy as np

    from rayllm.checkpoint.store import CheckpointStore

    store, ids = CheckpointStore(config.run.dir, config.storage), []
    for step in store.complete_steps():
        for path in store.fs.glob(posixpath.join(store.path(step), "consumed-rank*.npy")):
            ids.extend(tuple(int(v) for v in row) for row in np.load(io.BytesIO(store.fs.cat_file(path))))
    return ids


def figures(config: TrainConfig, started: float, ended: float, loss: float | None, faults: list[Fault]) -> RunFigures:
    """The run's figures from its records and checkpoints; ``faults`` get their times to the next
    step and past their step."""
    records = read_records(config.run.dir, "train", config.storage)
    steps, repeated, highest = 0, 0, 0
    for record in records:
        steps += 1
        repeated += record["step"] <= highest
        highest = max(highest, record["step"])
    _time_faults(records, faults)
    attempts = len(read_records(config.run.dir, "start", config.storage))
    split = TimeSplit.of(started, ended, [r["time"] for r in records], [f.at for f in faults])
    return RunFigures(ended - started, loss, steps, repeated, attempts, Counter(committed_ids(config)), split)


def _time_faults(records: list[dict], faults: list[Fault]) -> None:
    for fault in faults:
        fault.step = max((r["step"] for r in records if r["time"] <= fault.at), default=0)
        after = [r for r in records if r["time"] > fault.at]
        fault.next_step_s = after[0]["time"] - fault.at if after else None
        past = next((r for r in after if r["step"] > fault.step), None)
        fault.past_s = past["time"] - fault.at if past else None


def format_report(report: Report, header: list[str]) -> str:
    u, f = report.undisturbed, report.faulted
    lines = [
        *header,
        f"  effective training time ratio   {report.ratio:.3f}   ({u.wall_s:.0f} s undisturbed / {f.wall_s:.0f} s)",
        f"  faults delivered                {len(report.faults)}   ({f.attempts} attempts)",
        f"  steps trained twice             {f.steps_repeated}   (of {f.steps - f.steps_repeated})",
        f"  every sequence exactly once     {'yes' if report.exactly_once else 'NO'}   "
        f"({sum(u.ids.values())} sequences)",
        f"  final loss                      {u.loss:.6f} undisturbed, {f.loss:.6f} faulted "
        f"(relative difference {report.loss_rel_diff:.1e})",
        "  where the time went             undisturbed      faulted",
        *_split_lines(u.split, f.split),
        "  fault             at step   -> next step   -> past its step",
    ]
    for fault in report.faults:
        lines.append(
            f"  {fault.kind:<16}  {fault.step:>7}   {_seconds(fault.next_step_s):>10}   {_seconds(fault.past_s):>13}"
        )
    return "\n".join(lines)


def _split_lines(u: TimeSplit, f: TimeSplit) -> list[str]:
    rows = [
        ("start to the first step", u.to_first_step_s, f.to_first_step_s),
        ("steps no fault fell between", u.stepping_s, f.stepping_s),
        ("  one of them (median)", u.step_s, f.step_s),
        ("steps a fault fell between", u.faulted_s, f.faulted_s),
        ("the last step to the end", u.to_end_s, f.to_end_s),
    ]
    return [f"    {name:<28}  {_seconds(a):>10}   {_seconds(b):>10}" for name, a, b in rows]


def _seconds(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "-"
