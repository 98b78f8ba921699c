"""A source read a group of shards at a time, interleaved, so every batch mixes many shards.

Each epoch visits the source's shards in a permutation seeded by (seed, source, epoch),
cut into groups of at most ``mix`` shards (data.mix_shards); groups are numbered through
the epochs. A group's shards are read at once and merged by progress: the t-th sequence
(from 0) of a shard of b bytes has the time (t + 1) / b, and the group yields sequences in
(time, slot) order. Every shard of a group therefore drains at the same relative pace and
they end together, and the order is a pure function of the shards' contents and sizes:

    group g   =  shards perm_epoch[lo:hi] of epoch g // groups_per_epoch
    cursor    =  (g, per slot: (index, doc, doc_token) of the last sequence taken, or None)

Any prefix of the merge is "the first t_s sequences of each slot", so a restart needs
only the cursor (bounded by ``mix``), and re-reads only the group's shards. With mix = 1
a group is one shard and the order is the shard-after-shard order of earlier versions.

Written by hand: Ray Data's ordered execution yields one task's output after another, so
interleaving shards read by separate tasks would hold whole shards in memory; here one
task reads its group's shards side by side, holding a few blocks of each.
"""

from __future__ import annotations

import functools
import heapq
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from rayllm.data.encode import TokenizePool
from rayllm.data.source import SLOT_CURSOR_FIELDS, ShardPacker, SourceSpec, shard_visit
from rayllm.errors import DataError

SlotCursor = tuple[int, int, int]
Cursor = tuple[int, tuple[SlotCursor | None, ...]]  # (group, per slot)
OUTPUT_ROWS = 256  # rows per chunk a group yields
PACK_ROWS = 256  # rows a group buffers per shard, shared by its slots
MAX_GROUPS_PER_PASS = 256  # groups handed to one Ray Data execution: bounded planning at 100k shards


@functools.lru_cache(maxsize=16)
def shard_order(num_shards: int, seed: int, source: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's shard permutation (cached: a group needs it, and so does every other group of the epoch)."""
    if not shuffle:
        return np.arange(num_shards)
    return np.random.default_rng([seed, source, epoch]).permutation(num_shards)


def groups_per_epoch(plan: SourceSpec) -> int:
    return math.ceil(len(plan.shards) / max(1, plan.mix))


def group_members(plan: SourceSpec, group: int) -> list[tuple[int, int]]:
    """(epoch, shard) of each slot of ``group``; an epoch's groups differ in size by at most one."""
    per_epoch = groups_per_epoch(plan)
    epoch, place = divmod(group, per_epoch)
    n = len(plan.shards)
    order = shard_order(n, plan.seed, plan.order_key, epoch, plan.shuffle)
    return [(epoch, int(s)) for s in order[place * n // per_epoch : (place + 1) * n // per_epoch]]


def groups_from(plan: SourceSpec, first: int, cursor: Cursor | None, count: int) -> list[dict]:
    """``count`` group tasks from group ``first`` (restarted at ``cursor`` where it lies in that group)."""
    end = first + count if plan.repeat else min(first + count, groups_per_epoch(plan))
    return [
        {"source": plan.index, "group": g, "resume": json.dumps(cursor[1]) if cursor and cursor[0] == g else ""}
        for g in range(first, end)
    ]


class _Slot:
    """One shard of a group: its rows buffered as they are packed, and how many the merge took."""

    def __init__(self, rows: Iterator[dict[str, np.ndarray]], size: int, taken: int):
        self._rows, self.size, self.taken = rows, max(1, size), taken
        self._buffer: list[dict[str, np.ndarray]] = []
        self.available = 0  # buffered rows not yet picked
        self.markers: list[dict[str, np.ndarray]] = []  # a skipped shard's marker, passed on

    def time(self) -> float:
        return (self.taken + 1) / self.size

    def ready(self) -> bool:
        """Whether a row is there to pick, packing more of the shard if needed (False: it is done)."""
        while not self.available:
            chunk = next(self._rows, None)
            if chunk is None:
                return False
            if len(chunk["index"]) and chunk["index"][0] < 0:
                self.markers.append(chunk)
                continue
            self._buffer.append(chunk)
            self.available += len(chunk["index"])
        return True

    def take(self, n: int) -> dict[str, np.ndarray]:
        """The first ``n`` buffered rows (all picked already)."""
        parts, need = [], n
        while need:
            head = self._buffer[0]
            have = len(head["index"])
            if have <= need:
                parts.append(self._buffer.pop(0))
                need -= have
            else:
                parts.append({k: v[:need] for k, v in head.items()})
                self._buffer[0] = {k: v[need:] for k, v in head.items()}
                need = 0
        return parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class GroupPacker:
    """Packs a group's shards side by side and merges them by progress; the body of a Ray Data task."""

    def __init__(self, plan: SourceSpec, pool: TokenizePool | None = None):
        self.plan = plan
        self.shards = ShardPacker(plan, pool)

    def rows(self, group: int, resume: list | None = None) -> Iterator[dict[str, np.ndarray]]:
        members = group_members(self.plan, group)
        chunk = max(8, PACK_ROWS // len(members))
        slots = []
        for s, (epoch, shard) in enumerate(members):
            cursor = tuple(resume[s]) if resume and s < len(resume) and resume[s] is not None else None
            rows = self.shards.rows(shard_visit(self.plan.index, epoch, shard, cursor), chunk=chunk)
            size = self.plan.sizes[shard] if self.plan.sizes else 1
            slots.append(_Slot(rows, size, cursor[0] + 1 if cursor else 0))
        heap = [(slot.time(), s) for s, slot in enumerate(slots)]
        heapq.heapify(heap)
        picks: list[int] = []
        while heap:
            s = heap[0][1]
            slot = slots[s]
            ready = slot.ready()
            while slot.markers:  # a skipped shard: its marker row, placed in this group
                marker = slot.markers.pop(0)
                yield {**marker, "group": np.array([group], dtype=np.int64), "slot": np.array([s], dtype=np.int32)}
            if not ready:
                heapq.heappop(heap)
                continue
            picks.append(s)
            slot.available -= 1
            slot.taken += 1
            heapq.heapreplace(heap, (slot.time(), s))
            if len(picks) == OUTPUT_ROWS:
                yield _gather(slots, picks, group)
                picks = []
        if picks:
            yield _gather(slots, picks, group)

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """The rows of each group in ``batch``, each chunk saying how many tokenize tasks ran for it;
        the time its consumer takes to ask for the next chunk is the demand the pool is sized by."""
        pool = self.shards.pool
        for i in range(len(batch["group"])):
            resume = str(batch["resume"][i])
            for chunk in self.rows(int(batch["group"][i]), json.loads(resume) if resume else None):
                tasks = pool.sizer.tasks if pool else 0
                chunk["tokenize_tasks"] = np.full(len(chunk["index"]), tasks, dtype=np.int16)
                handed = time.monotonic()
                yield chunk
                if pool:
                    pool.sizer.waited_for_consumer(time.monotonic() - handed)
                    pool.sizer.update()


def _gather(slots: list[_Slot], picks: list[int], group: int) -> dict[str, np.ndarray]:
    """The picked rows in pick order, with their group and slot."""
    order = np.asarray(picks)
    taken = {s: slots[s].take(int(c)) for s, c in zip(*np.unique(order, return_counts=True), strict=True)}
    first = next(iter(taken.values()))
    out = {k: np.empty((len(order), *v.shape[1:]), dtype=v.dtype) for k, v in first.items()}
    for s, part in taken.items():
        where = np.flatnonzero(order == s)
        for k, v in part.items():
            out[k][where] = v
    out["group"] = np.full(len(order), group, dtype=np.int64)
    out["slot"] = order.astype(np.int32)
    return out


def advance(cursor: Cursor | None, rows: np.ndarray) -> Cursor | None:
    """The cursor after ``rows`` (records in stream order) were taken."""
    if not len(rows):
        return cursor
    group = int(rows["group"][-1])
    slots = list(cursor[1]) if cursor is not None and cursor[0] == group else []
    mine = rows[rows["group"] == group][::-1]
    found, last = np.unique(mine["slot"], return_index=True)
    slots += [None] * (int(found[-1]) + 1 - len(slots))
    for slot, row in zip(found, mine[last], strict=True):
        slots[int(slot)] = tuple(int(row[f]) for f in SLOT_CURSOR_FIELDS)
    return group, tuple(slots)


def cursor_from_state(raw, plan: SourceSpec) -> Cursor | None:
    """A checkpoint's cursor for this source; checkpoints from before groups (a flat
    (item, index, doc, doc_token)) read as group = item when the plan reads one shard at a time."""
    if raw is None:
        return None
    if len(raw) == 4 and all(isinstance(v, int) for v in raw):
        if plan.mix != 1:
            raise DataError(
                "the checkpoint's data position is from a run that read one shard at a time; resume it with "
                "data.mix_shards=1 (or start a new run to mix shards)"
            )
        item, index, doc, doc_token = raw
        return item, ((index, doc, doc_token),)
    group, slots = raw
    return int(group), tuple(tuple(c) if c is not None else None for c in slots)


def local_chunks(plan: SourceSpec, cursor: Cursor | None) -> Iterator[dict[str, np.ndarray]]:
    """The source's stream from ``cursor`` without Ray: column batches, as Ray Data yields them."""
    packer = GroupPacker(plan)
    yield from passes(
        plan, cursor, lambda tasks: (b for t in tasks for b in packer.rows(t["group"], _resume(t["resume"])))
    )


def _resume(text: str) -> list | None:
    return json.loads(text) if text else None


def passes(
    plan: SourceSpec, cursor: Cursor | None, run_pass: Callable[[list[dict]], Iterable[dict]]
) -> Iterator[dict[str, np.ndarray]]:
    """Run the source pass after pass (``epochs_per_pass`` epochs, at most MAX_GROUPS_PER_PASS
    groups each) from the cursor on. A whole epoch of groups that yields no sequence is an
    error rather than an endless loop."""
    first = cursor[0] if cursor else 0
    per_epoch = groups_per_epoch(plan)
    count = max(1, min(MAX_GROUPS_PER_PASS, plan.epochs_per_pass * per_epoch))
    barren = 0  # groups in a row that gave no sequence, counted from a fresh start
    while True:
        tasks = groups_from(plan, first, cursor, count)
        if not tasks:
            return
        produced = 0
        for batch in run_pass(tasks):
            produced += int((np.asarray(batch["index"]) >= 0).sum())
            yield batch
        barren = barren + len(tasks) if produced == 0 and cursor is None else 0
        if barren >= per_epoch and plan.repeat:
            raise DataError(
                f"data source {plan.name!r} produced no sequences in a whole epoch: its documents hold fewer than "
                f"data.seq_len + 1 tokens in every shard (or every shard was skipped). Add data or lower data.seq_len"
            )
        first, cursor = tasks[-1]["group"] + 1, None
