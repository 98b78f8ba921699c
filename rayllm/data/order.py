"""The global stream: sources mixed by position, shuffled in windows, cut into global batches.

The order is fixed by the seed alone, never by the number of workers:

    position p  ->  source labels(p)  (mixture.py)  ->  that source's next sequence
    window k    =   positions [k*U, (k+1)*U), permuted by rng(seed, k)
    step s      =   positions [s*G, (s+1)*G);  rank r of W takes the r-th contiguous slice

The data state saved with a checkpoint is ``DataState``: a window boundary at or before
the consumed position and, per source, the cursor of the last sequence it gave before
that boundary. A restart rebuilds the stream from there, on any number of workers,
re-reading only the window that was in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayllm.data import mixture
from rayllm.data.shard_groups import Cursor, advance, cursor_from_state, local_chunks
from rayllm.data.source import SourceSpec, to_records
from rayllm.errors import DataError

UNSHUFFLED_UNIT = 1024  # positions assembled at a time when shuffling is off
RECENT_VISITS = 1024  # shard visits whose left-out records a data state remembers as counted


@dataclass
class DataState:
    """Where the stream restarts: JSON-friendly, part of every checkpoint."""

    position: int = 0
    cursors: list[list[int] | None] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    # Records left out so far (no string, empty, too long), per source name and reason, and the
    # latest shard visits counted in them (a restart meets those again: DropTally).
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    dropped_visits: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        extra = {"dropped": self.dropped, "dropped_visits": self.dropped_visits} if self.dropped else {}
        return {"position": self.position, "cursors": self.cursors, "skipped": self.skipped, **extra}

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> DataState:
        raw = raw or {}
        return cls(
            raw.get("position", 0),
            list(raw.get("cursors", [])),
            list(raw.get("skipped", [])),
            {name: dict(counts) for name, counts in raw.get("dropped", {}).items()},
            [list(v) for v in raw.get("dropped_visits", [])],
        )

    def cursor(self, source: int, plan: SourceSpec) -> Cursor | None:
        return cursor_from_state(self.cursors[source] if source < len(self.cursors) else None, plan)


class DropTally:
    """Records left out per source and reason, each shard visit counted once: a restart refills the
    window it resumes from and meets the visits counted there again (kept: the latest RECENT_VISITS)."""

    def __init__(self, state: DataState):
        self.totals = {name: dict(counts) for name, counts in state.dropped.items()}
        self.visits = [tuple(v) for v in state.dropped_visits]

    def add(self, name: str, entry: dict[str, Any]) -> None:
        visit = (entry["source"], entry["epoch"], entry["shard"])
        if visit in self.visits:
            return
        self.visits = [*self.visits, visit][-RECENT_VISITS:]
        counts = self.totals.setdefault(name, {})
        for reason, n in entry["dropped"].items():
            counts[reason] = counts.get(reason, 0) + n

    def stamp(self, state: DataState) -> None:
        state.dropped = {name: dict(counts) for name, counts in self.totals.items()}
        state.dropped_visits = [list(v) for v in self.visits]


class SourceReader:
    """Takes rows of one source on demand and remembers the cursor of the last row taken."""

    def __init__(
        self,
        batches: Iterator[dict[str, np.ndarray]],
        cursor,
        on_skip: Callable[[dict], None],
        on_drop: Callable[[dict], None] = lambda entry: None,
    ):
        self._batches, self.cursor, self._on_skip, self._on_drop = batches, cursor, on_skip, on_drop
        self._buffer: list[np.ndarray] = []
        self._have = 0
        self.exhausted = False

    def take(self, n: int) -> np.ndarray | None:
        while self._have < n and not self.exhausted:
            try:
                batch = next(self._batches)
            except StopIteration:
                self.exhausted = True
                break
            rows, skipped, dropped = to_records(batch)
            for s in skipped:
                self._on_skip(s)
            for d in dropped:
                self._on_drop(d)
            if len(rows):
                self._buffer.append(rows)
                self._have += len(rows)
        if not self._buffer:
            return None
        rows = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        taken, rest = rows[:n], rows[n:]
        self._buffer, self._have = ([rest] if len(rest) else []), len(rest)
        self.cursor = advance(self.cursor, taken)
        return taken


def global_windows(
    readers: list[SourceReader],
    weights: list[float],
    *,
    window: int,
    seed: int,
    state: DataState,
    skipped: list[dict],
    tally: DropTally | None = None,
) -> Iterator[tuple[np.ndarray, DataState]]:
    """Windows of the global stream from ``state.position``, each with the state at its start."""
    shuffle = window > 1
    unit = window if shuffle else UNSHUFFLED_UNIT
    if state.position % unit:
        raise DataError(
            f"the checkpoint's data position {state.position} is not a multiple of data.shuffle_window ({window}); "
            "resume with the shuffle_window the run started with"
        )
    k = state.position // unit
    while True:
        start = k * unit
        meta = DataState(start, [_plain(r.cursor) for r in readers])
        lab = mixture.labels(weights, start, start + unit, seed)
        rows, complete = _assemble(readers, lab)
        # Skips found while filling this window are reported with it; a restart from its start
        # meets them again and counts each once.
        meta.skipped = list(skipped)
        if tally is not None:
            tally.stamp(meta)
        if shuffle and len(rows):
            rows = rows[np.random.default_rng([seed, k]).permutation(len(rows))]
        if len(rows):
            yield rows, meta
        if not complete:
            return
        k += 1


def _plain(cursor: Cursor | None) -> list | None:
    """A cursor as JSON-friendly lists."""
    if cursor is None:
        return None
    return [cursor[0], [list(c) if c is not None else None for c in cursor[1]]]


def _assemble(readers: list[SourceReader], lab: np.ndarray) -> tuple[np.ndarray, bool]:
    """Rows for positions labelled ``lab``, in position order; cut short where a source ran out."""
    counts = np.bincount(lab, minlength=len(readers))
    taken = [readers[s].take(int(c)) if c else None for s, c in enumerate(counts)]
    cutoff = len(lab)
    for s, c in enumerate(counts):
        got = 0 if taken[s] is None else len(taken[s])
        if got < c:
            cutoff = min(cutoff, int(np.flatnonzero(lab == s)[got]))
    present = [t for t in taken if t is not None]
    if not present:
        return np.zeros(0), False
    out = np.empty(cutoff, dtype=present[0].dtype)
    for s, t in enumerate(taken):
        where = np.flatnonzero(lab[:cutoff] == s)
        if len(where):
            out[where] = t[: len(where)]
    return out, cutoff == len(lab)


def step_batches(
    windows: Iterator[tuple[np.ndarray, DataState]], *, start: int, global_batch: int
) -> Iterator[tuple[np.ndarray, DataState]]:
    """Global batches (positions [s*G, (s+1)*G) from ``start`` on), each with the state to resume it.

    The state is that of the window holding the batch's first position: saved after the
    step, it lets a restart rebuild that window and skip what was already trained on.
    """
    pending: list[tuple[np.ndarray, DataState]] = []  # segments of consecutive positions
    have, produced = 0, 0
    skip: int | None = None
    for rows, meta in windows:
        produced += len(rows)
        if skip is None:
            skip = start - meta.position
            if skip < 0:
                raise DataError(f"internal: stream restarted at {meta.position}, after the consumed position {start}")
        if skip:
            cut = min(skip, len(rows))
            rows, skip = rows[cut:], skip - cut
        if len(rows):
            pending.append((rows, meta))
            have += len(rows)
        while have >= global_batch:
            batch_meta = pending[0][1]
            parts, need = [], global_batch
            while need:
                seg, seg_meta = pending[0]
                parts.append(seg[:need])
                if len(seg) > need:
                    pending[0] = (seg[need:], seg_meta)
                    need = 0
                else:
                    pending.pop(0)
                    need -= len(seg)
            have -= global_batch
            yield (np.concatenate(parts) if len(parts) > 1 else parts[0]), batch_meta
    if produced == 0:
        raise DataError(
            "the dataset produced no sequences: its documents hold fewer than data.seq_len + 1 tokens in every "
            "shard. Add data or lower data.seq_len"
        )


@dataclass(frozen=True)
class DataSlicing:
    """How the ranks share each global batch: ranks row-major over (stages, slices,
    ranks_per_slice), as rayllm.parallel.layout lays them out. The ``ranks_per_slice`` neighbours
    (a TP group) train on the same rows, and so does each pipeline stage's rank of one replica."""

    world_size: int
    ranks_per_slice: int = 1
    stages: int = 1

    @property
    def slices(self) -> int:
        return self.world_size // (self.stages * self.ranks_per_slice)

    def slice_of(self, rank: int) -> int:
        return (rank % (self.world_size // self.stages)) // self.ranks_per_slice

    def records(self, rank: int) -> bool:
        """Whether ``rank`` counts its slice's sources and ids: one rank per slice, the first
        stage's first rank of it (the others train on the same rows)."""
        return rank < self.world_size // self.stages and rank % self.ranks_per_slice == 0


def rank_slice(rows: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    per_rank = len(rows) // world_size
    return rows[rank * per_rank : (rank + 1) * per_rank]


@dataclass
class StreamSpec:
    """A whole stream: its sources (one, or a weighted mixture), shuffle window and seed."""

    sources: list[SourceSpec]
    window: int
    seed: int

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.sources]


ChunkSource = Callable[[SourceSpec, "Cursor | None"], Iterator[dict[str, np.ndarray]]]


def open_stream(
    plan: StreamSpec, state: DataState, *, consumed: int, global_batch: int, chunks: ChunkSource
) -> Iterator[tuple[np.ndarray, DataState]]:
    """Global batches from ``consumed`` on, restarted from ``state``; ``chunks`` runs one source (Ray or local)."""
    skipped = list(state.skipped)

    def on_skip(entry: dict) -> None:
        src = plan.sources[entry["source"]]
        entry = {**entry, "name": src.name, "uri": src.shards[entry["shard"]]}
        if not any(
            s["source"] == entry["source"] and s["epoch"] == entry["epoch"] and s["shard"] == entry["shard"]
            for s in skipped
        ):
            skipped.append(entry)

    tally = DropTally(state)

    def on_drop(entry: dict) -> None:
        tally.add(plan.sources[entry["source"]].name, entry)

    cursors = [state.cursor(i, src) for i, src in enumerate(plan.sources)]
    readers = [SourceReader(chunks(src, c), c, on_skip, on_drop) for src, c in zip(plan.sources, cursors, strict=True)]
    windows = global_windows(
        readers, plan.weights, window=plan.window, seed=plan.seed, state=state, skipped=skipped, tally=tally
    )
    return step_batches(windows, start=consumed, global_batch=global_batch)


def first_batches(plan: StreamSpec, count: int, global_batch: int) -> list[np.ndarray]:
    """The first ``count`` global batches of a stream, computed in-process (validation: small, read once)."""
    return [rows for _, (rows, _) in zip(range(count), local_stream(plan, global_batch=global_batch), strict=False)]


def local_stream(plan: StreamSpec, state: DataState | None = None, *, consumed: int = 0, global_batch: int):
    """The stream computed in-process, without Ray (torchrun, validation, tests)."""
    return open_stream(plan, state or DataState(), consumed=consumed, global_batch=global_batch, chunks=local_chunks)
