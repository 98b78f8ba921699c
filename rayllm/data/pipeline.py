"""The token stream: shards -> documents -> tokens -> packed sequences, in one global order.

The order is fixed by the seed alone: each epoch visits the shards in a seeded
permutation, and each shard packs its documents into consecutive sequences. Every
sequence therefore has a stable id (epoch, shard, index) and a global position that do
not depend on the number of workers. Ray Data executes the stream (an actor pool of
tokenizers, ``preserve_order`` on); without Ray the same functions run in-process, so
torchrun and Ray see identical data.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from rayllm.config import StorageSettings
from rayllm.data import tokenizer as tok
from rayllm.data.packing import pack
from rayllm.data.shards import iter_documents
from rayllm.errors import DataError

ENCODE_GROUP = 64  # documents per encode_batch call: enough to use tokenizers' threads


@dataclass
class StreamPlan:
    """All a worker or a Ray Data actor needs to rebuild the stream; small and picklable."""

    shards: list[str]
    text_field: str
    storage: StorageSettings
    tokenizer_json: str
    seq_len: int
    seed: int
    epochs: int
    shuffle: bool = True


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    if not shuffle:
        return list(range(num_shards))
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(num_shards)]


def work_items(plan: StreamPlan) -> list[dict[str, int]]:
    """One item per (epoch, shard), in stream order."""
    return [
        {"epoch": epoch, "shard": shard}
        for epoch in range(plan.epochs)
        for shard in shard_order(len(plan.shards), plan.seed, epoch, plan.shuffle)
    ]


class ShardPacker:
    """Tokenizes and packs one shard at a time; a Ray Data ``map_batches`` callable class."""

    def __init__(self, plan: StreamPlan):
        self.plan = plan
        self.tokenizer = tok.load(plan.tokenizer_json, "of this run")
        self.eos = tok.eos_id(self.tokenizer)

    def sequences(self, epoch: int, shard: int) -> Iterator[dict[str, np.ndarray]]:
        uri = self.plan.shards[shard]
        docs = iter_documents(uri, self.plan.text_field, self.plan.storage)
        token_lists = (
            ids
            for group in _batched(docs, ENCODE_GROUP)
            for ids in (e.ids for e in self.tokenizer.encode_batch(group, add_special_tokens=False))
        )
        start = 0
        for tokens in pack(token_lists, self.eos, self.plan.seq_len + 1):
            n = len(tokens)
            yield {
                "tokens": tokens,
                "epoch": np.full(n, epoch, dtype=np.int32),
                "shard": np.full(n, shard, dtype=np.int32),
                "index": np.arange(start, start + n, dtype=np.int64),
            }
            start += n

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        for epoch, shard in zip(batch["epoch"], batch["shard"], strict=True):
            yield from self.sequences(int(epoch), int(shard))


def _batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(items)
    while group := list(itertools.islice(it, n)):
        yield group


ID_FIELDS = ("epoch", "shard", "index")


def to_records(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Columns to one structured array per chunk: ``rows["tokens"]`` (n, seq_len + 1) and the ids.

    One array keeps each sequence's id attached through shuffling and rank slicing.
    """
    tokens = batch["tokens"]
    rows = np.empty(
        len(tokens),
        dtype=[("tokens", np.int32, tokens.shape[1:]), ("epoch", np.int32), ("shard", np.int32), ("index", np.int64)],
    )
    for name in ("tokens", *ID_FIELDS):
        rows[name] = batch[name]
    return rows


def local_stream(plan: StreamPlan) -> Iterator[np.ndarray]:
    """The stream without Ray: record chunks (see ``to_records``)."""
    packer = ShardPacker(plan)
    for item in work_items(plan):
        for chunk in packer.sequences(item["epoch"], item["shard"]):
            yield to_records(chunk)


_PACKERS: dict[int, ShardPacker] = {}


def pack_shards(batch: dict[str, np.ndarray], plan: StreamPlan) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data task: one tokenizer per worker process, reused by every task it runs.

    Tasks rather than an actor pool: Ray keeps worker processes warm, so the first
    sequence arrives in about a second instead of after an actor's cold start.
    """
    key = hash(plan.tokenizer_json)
    packer = _PACKERS.get(key)
    if packer is None or packer.plan != plan:
        packer = _PACKERS[key] = ShardPacker(plan)
    yield from packer(batch)


def _idle_throttle_class():
    """A Ray Data execution callback that sleeps while no task is in flight.

    Written by hand because Ray Data (2.60) has no such setting: its scheduling loop
    blocks in ``ray.wait`` only while tasks run. When training is the slower side, every
    task is held back by backpressure and the loop spins, taking a core and the GIL from
    the training thread in the same process (measured: 2.4x slower steps on 2 cores).
    """
    from ray.data._internal.execution.execution_callback import ExecutionCallback

    class IdleThrottle(ExecutionCallback):
        def on_execution_step(self, executor) -> None:
            try:
                busy = any(op.get_active_tasks() for op in executor._topology)
            except Exception:  # internal layout changed: never break execution over this
                return
            if not busy:
                time.sleep(0.02)

    return IdleThrottle


def ray_dataset(plan: StreamPlan, parallelism: int, cpus_per_task: float = 0.5):
    """The stream as a Ray Dataset (lazy, streaming; order preserved by the ingest options)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    throttle = _idle_throttle_class()
    if not any(c.__name__ == throttle.__name__ for c in ctx.custom_execution_callback_classes):
        ctx.custom_execution_callback_classes.append(throttle)

    items = work_items(plan)
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    return ds.map_batches(
        pack_shards,
        fn_kwargs={"plan": plan},
        batch_size=1,
        compute=ray.data.TaskPoolStrategy(size=parallelism),
        num_cpus=cpus_per_task,
    )


def ray_chunks(iterator) -> Callable[[], Iterator[np.ndarray]]:
    """Adapt a Ray Train dataset shard (a DataIterator) to the chunk stream."""

    def chunks() -> Iterator[np.ndarray]:
        for batch in iterator.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=4):
            yield to_records(batch)

    return chunks


def window_shuffled(
    source: Callable[[], Iterator[np.ndarray]], window: int, seed: int
) -> Callable[[], Iterator[np.ndarray]]:
    """The stream with each consecutive window of ``window`` sequences permuted by the seed.

    Packed sequences of one shard are consecutive pieces of the same documents; a batch
    drawn from them would be one file's worth of text. Permuting within fixed windows
    of the global stream decorrelates batches while keeping the order a function of the
    seed alone (every rank computes the same permutation) and every sequence exactly once.
    """
    if window <= 1:
        return source

    def shuffled() -> Iterator[np.ndarray]:
        buffer: list[np.ndarray] = []
        have, index = 0, 0
        for chunk in source():
            buffer.append(chunk)
            have += len(chunk)
            while have >= window:
                rows = np.concatenate(buffer)
                order = np.random.default_rng([seed, index]).permutation(window)
                yield rows[:window][order]
                index += 1
                rest = rows[window:]
                buffer, have = ([rest] if len(rest) else []), len(rest)
        if have:
            rows = np.concatenate(buffer)
            yield rows[np.random.default_rng([seed, index]).permutation(len(rows))]

    return shuffled


def rank_batches(
    source: Callable[[], Iterator[np.ndarray]],
    *,
    start: int,
    global_batch: int,
    rank: int,
    world_size: int,
    repeat: bool,
) -> Iterator[np.ndarray]:
    """This rank's share (global_batch / world_size rows) of each global batch.

    Global batch s holds stream positions [s * G, (s + 1) * G); rank r takes the r-th
    contiguous slice of it. The first ``start`` positions (already consumed before a
    restart) are skipped, so a resumed run continues with the next unseen sequence.
    """
    per_rank = global_batch // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    position = 0
    mine: list[np.ndarray] = []
    have = 0
    while True:
        produced = 0
        for chunk in source():
            produced += len(chunk)
            n = len(chunk)
            offsets = np.arange(position, position + n)
            position += n
            keep = offsets >= start
            within = (offsets - start) % global_batch
            keep &= (within >= lo) & (within < hi)
            if keep.any():
                mine.append(chunk[keep])
                have += int(keep.sum())
            while have >= per_rank:
                rows = np.concatenate(mine)
                yield rows[:per_rank]
                rest = rows[per_rank:]
                mine, have = ([rest] if len(rest) else []), len(rest)
        if produced == 0:
            raise DataError(
                "the dataset produced no sequences: its documents hold fewer than data.seq_len + 1 "
                "tokens in every shard. Add data or lower data.seq_len"
            )
        if not repeat:
            return


def prefetched(iterator: Iterator[np.ndarray], depth: int = 2) -> Iterator[np.ndarray]:
    """Run ``iterator`` ahead in a thread, so the stream starts (and waits) beside the step.

    The training stream's first batch is then being prepared while step-0 validation runs.
    Errors from the stream are raised in the consumer.
    """
    import queue
    import threading

    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill() -> None:
        try:
            for item in iterator:
                items.put(item)
            items.put(done)
        except BaseException as e:  # handed to the consumer, which raises it
            items.put(e)

    threading.Thread(target=fill, daemon=True, name="rayllm-prefetch").start()
    while True:
        item = items.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item
