"""What rank 0 tells the driver about a run: one typed event per kind of run record.

The loop (trainer.py, watchdog.py), the checkpointer and the Ray worker adapter build them and
hand them to ``Session.emit``; the driver's RunMonitor (runtime/monitor.py) dispatches on their
type. ``to_record()`` is an event's line of metrics.jsonl, less what the monitor adds (its
"time", a train record's "stragglers"); ``from_record()`` reads such a record back. The Ray
workers send records, not events, through the progress queue (runtime/ray_worker.py).

A bottom module: it imports nothing of rayllm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

_KEY = "key"  # the field's record key, where that is no Python name ("from", "bytes")
_OPTIONAL = "optional"  # the record leaves the field out at its default (as its emitters always did)
_REST = "rest"  # a dict field: the record's other keys, flattened into it


def _key(name: str) -> Any:
    return field(metadata={_KEY: name})


def _optional(default: Any) -> Any:
    return field(default=default, metadata={_OPTIONAL: True})


def _rest() -> Any:
    return field(default_factory=dict, metadata={_REST: True})


@dataclass(frozen=True, kw_only=True)
class RunEvent:
    """One run record: ``kind`` names it in the record; every event happens at a ``step``."""

    kind: ClassVar[str]
    step: int

    def to_record(self) -> dict[str, Any]:
        """The record: "kind" first, then the fields in their order (a rest field flattened in)."""
        record: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get(_REST):
                record.update(value)
            elif not (f.metadata.get(_OPTIONAL) and value == f.default):
                record[f.metadata.get(_KEY, f.name)] = value
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunEvent:
        """The event of ``record`` (as ``to_record`` made it); a ValueError for keys it has no place for."""
        if record.get("kind") != cls.kind:
            raise ValueError(f"a {record.get('kind')!r} record is no {cls.kind!r} event")
        left = {k: v for k, v in record.items() if k != "kind"}
        values: dict[str, Any] = {}
        rest = None
        for f in dataclasses.fields(cls):
            key = f.metadata.get(_KEY, f.name)
            if f.metadata.get(_REST):
                rest = f.name
            elif key in left:
                values[f.name] = left.pop(key)
        if rest is not None:
            values[rest] = left
        elif left:
            raise ValueError(f"a {cls.kind!r} record with keys no event field holds: {sorted(left)}")
        return cls(**values)  # a missing key: TypeError


@dataclass(frozen=True, kw_only=True)
class Start(RunEvent):
    """Rank 0, once an attempt has restored its state, before its first step: the world it trains on."""

    kind: ClassVar[str] = "start"
    world_size: int
    params: int
    flops_per_token: float
    peak_flops: float  # every rank's measured matmul peak together
    # Every rank's published dense bf16 peak together (MFU's denominator) where the GPU is known
    # and trains in bf16; else None, and MFU is against peak_flops.
    published_peak_flops: float | None = None
    restarts: int
    resumed_from: str | None  # "memory" or "storage"; None: a fresh start
    accum_steps: int  # micro-batches per rank per step
    layout: str  # as Layout.describe() says it: "FSDP 2", "1 rank"
    nodes: list[str]  # per rank


@dataclass(frozen=True, kw_only=True)
class Train(RunEvent):
    """Rank 0, at every train.log_every-th step and the last: the log window's metrics
    (MetricWindow.summary, loop/metrics.py), what earlier ones left (val_loss) and the realised mixture."""

    kind: ClassVar[str] = "train"
    loss: float
    perplexity: float
    lr: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    tokens_per_s_per_worker: float
    flops_per_s: float
    mfu: float  # against the published peak where known (Start.published_peak_flops), else the measured
    mfu_measured: float | None = None  # against the matmul peak measured at the start (absent in older records)
    step_time_s: float
    data_wait_frac: float
    data_wait_max_frac: float
    data_wait_max_rank: int
    rank_own_step_s: list[float]
    rank_data_wait_s: list[float]
    rank_collective_wait_s: list[float]
    peak_memory_bytes: int
    peak_reserved_bytes: int | None = None  # CUDA: the caching allocator's most (absent in older records)
    alloc_retries: int | None = None  # CUDA: cache flushes to satisfy an allocation, so far
    world_size: int
    restarts: int
    skipped_shards: int
    metrics: dict[str, Any] = _rest()  # the others: val_loss once validated, older checkpoints' keys
    mixture: dict[str, float]  # each source's share of the sequences trained on so far

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any], mixture: dict[str, float]) -> Train:
        """The event of the loop's metrics dict (its "step" included) and mixture."""
        return cls.from_record({"kind": cls.kind, **metrics, "mixture": mixture})


@dataclass(frozen=True, kw_only=True)
class Val(RunEvent):
    """Rank 0, after validation: at step 0 of a fresh run, every train.val_every-th step and the last."""

    kind: ClassVar[str] = "val"
    val_loss: float


@dataclass(frozen=True, kw_only=True)
class Samples(RunEvent):
    """Rank 0, after validation where the config has sample prompts: each with its generated text."""

    kind: ClassVar[str] = "samples"
    samples: list[dict[str, str]]  # {"prompt", "text"}


@dataclass(frozen=True, kw_only=True)
class Checkpoint(RunEvent):
    """Rank 0 (the checkpointer), once a stored checkpoint is committed: the training time it cost."""

    kind: ClassVar[str] = "checkpoint"
    stall_s: float
    final: bool  # the run's (or the attempt's) last


@dataclass(frozen=True, kw_only=True)
class MemoryCheckpoint(RunEvent):
    """Rank 0 (the checkpointer), once the keepers hold every rank's part of an in-memory checkpoint."""

    kind: ClassVar[str] = "memory_checkpoint"
    stall_s: float  # the training time it cost: starting it, and waiting for the copy to CPU memory
    nbytes: int = _key("bytes")  # what the keepers hold, both copies
    write_s: float | None = None  # from the start of the save to its marker, while training went on


@dataclass(frozen=True, kw_only=True)
class Kept(RunEvent):
    """Rank 0's checkpoint housekeeping, once a milestone (train.keep_checkpoint_every) is copied to run.dir/kept/."""

    kind: ClassVar[str] = "kept"
    uri: str


@dataclass(frozen=True, kw_only=True)
class RunWarning(RunEvent):
    """What rank 0 warns of while training goes on: checkpoint housekeeping that failed (the next
    commit tries again), a ``torch.compile`` that cannot work here (the run trains eager)."""

    kind: ClassVar[str] = "warning"
    message: str


@dataclass(frozen=True, kw_only=True)
class Failure(RunEvent):
    """Any rank whose attempt fails: the Ray worker adapter on an exception, the hang watchdog
    (its lowest reporting rank) on a hang. ``final``: the same failure again, the run ends."""

    kind: ClassVar[str] = "failure"
    rank: int
    node: str | None = _optional(None)
    message: str
    final: bool = _optional(False)


@dataclass(frozen=True, kw_only=True)
class Preempted(RunEvent):
    """Rank 0, when a rank was asked to stop (SIGTERM, a preemption notice): checkpointed, the attempt ends."""

    kind: ClassVar[str] = "preempted"
    rank: int


@dataclass(frozen=True, kw_only=True)
class NonFinite(RunEvent):
    """Rank 0, at a step whose loss or gradient norm is not finite: the step is skipped."""

    kind: ClassVar[str] = "nonfinite"
    loss: float
    grad_norm: float
    in_row: int  # non-finite steps in a row, this one included


@dataclass(frozen=True, kw_only=True)
class Stopped(RunEvent):
    """Rank 0, when a stop (SIGTERM, SIGINT) ended the run with a checkpoint: running again resumes from it."""

    kind: ClassVar[str] = "stopped"


@dataclass(frozen=True, kw_only=True)
class FirstStep(RunEvent):
    """Rank 0, after an attempt's first step: when its start-up stages ended (rank 0's wall clock;
    bench/recovery.py reads them) and whether its data came from the running stream (Ray)."""

    kind: ClassVar[str] = "first_step"
    phases: dict[str, float]
    stream_kept: bool | None


@dataclass(frozen=True, kw_only=True)
class Skipped(RunEvent):
    """Rank 0, at a step whose batches skipped unreadable shards (data.on_bad_shard: skip)."""

    kind: ClassVar[str] = "skipped"
    shards: list[dict[str, Any]]  # {"source", "epoch", "shard", "name", "uri", "error", ...}


@dataclass(frozen=True, kw_only=True)
class DataChanged(RunEvent):
    """Rank 0, at a resume on data other than its checkpoint's with data.on_change: restart: a new
    data order starts at this step (rayllm/data/fingerprint.py)."""

    kind: ClassVar[str] = "data_changed"
    checkpoint: str  # the checkpoint's folder name
    changes: list[str]  # each in words: "data.seq_len 256 -> 512"
    restarted: list[str]  # sources read from their beginning
    kept: list[str]  # sources that go on where they were


@dataclass(frozen=True, kw_only=True)
class Dropped(RunEvent):
    """Rank 0, at a step whose batches left records out (text no string, empty, over
    data.max_document_bytes with data.on_bad_shard: skip), and at an attempt's first step when some were."""

    kind: ClassVar[str] = "dropped"
    records: dict[str, dict[str, int]]  # so far: source name -> reason (not_text, empty, too_long) -> count


@dataclass(frozen=True, kw_only=True)
class Done(RunEvent):
    """Rank 0, when a run starts at or past its last step: nothing to train; its latest checkpoint's metrics."""

    kind: ClassVar[str] = "done"
    metrics: dict[str, Any] = _rest()

    def __post_init__(self) -> None:
        # The loop hands over the checkpoint's metrics whole: where they have a "step" (the last log's,
        # which may be before the checkpoint's), the record has always said that one.
        if "step" in self.metrics:
            metrics = dict(self.metrics)
            object.__setattr__(self, "step", metrics.pop("step"))
            object.__setattr__(self, "metrics", metrics)


@dataclass(frozen=True, kw_only=True)
class Resize(RunEvent):
    """The driver's monitor itself, when an attempt starts on another number of workers than the last."""

    kind: ClassVar[str] = "resize"
    from_workers: int = _key("from")
    to_workers: int = _key("to")


EVENTS: tuple[type[RunEvent], ...] = (
    Start,
    Train,
    Val,
    Samples,
    Checkpoint,
    MemoryCheckpoint,
    Kept,
    RunWarning,
    Failure,
    Preempted,
    NonFinite,
    Stopped,
    FirstStep,
    Skipped,
    DataChanged,
    Dropped,
    Done,
    Resize,
)
KINDS: dict[str, type[RunEvent]] = {event.kind: event for event in EVENTS}


def from_record(record: dict[str, Any]) -> RunEvent:
    """The event of a record of any kind (a ValueError for a kind no event has)."""
    kind = record.get("kind")
    if kind not in KINDS:
        raise ValueError(f"no run event of kind {kind!r}")
    return KINDS[kind].from_record(record)
