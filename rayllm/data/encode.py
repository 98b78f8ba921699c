"""Tokenize a reading task's documents in Ray tasks, as many at once as the run consumes.

A group's reading task (shard_groups.py) reads, packs and merges its shards in order; that part
is cheap (about a tenth of the time). Tokenizing is the rest, and it is independent per
document, so the reading task hands batches of documents to short Ray tasks and packs
their token ids in the original order: the stream is the same whatever the number of
tasks. How many run at once follows from two measurements, renewed every SIZE_PERIOD_S:

    per-task rate  r = text bytes tokenized / task seconds           (one core per task)
    demand         d = text bytes the stream took / wall seconds     (when the reader waits for it)
    tasks          n = ceil(HEADROOM * d / r), at most data.tokenize_tasks

When the reader never waits for its consumer it is the bottleneck: the demand is unknown
(at least d), so it adds tasks while that raises its rate and stops where the CPUs are
saturated. Below half a task the reader tokenizes in its own process (a laptop run).

Written by hand: Ray Data's autoscaling sizes an operator by its input queue, not by what
the consumer downstream takes, and its ordered output would serialise a group's shards.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

HEADROOM = 1.25
SIZE_PERIOD_S = 2.0
SATURATED_HOLD_S = 30.0
IDLE_FRACTION = 0.05  # the reader waited for its consumer at least this part of a period: demand is measured
JOB_DOCS = 64  # documents per tokenize task ...
JOB_BYTES = 1 << 20  # ... or this much text, whichever comes first
RESULT_TIMEOUT_S = 300.0  # a tokenize task that gives nothing for this long fails the stream (named)

_TOKENIZERS: dict[int, object] = {}


def _encode(key: int, tokenizer_ref: list, texts: list[str]) -> tuple[np.ndarray, np.ndarray, float]:
    """A tokenize task: (all token ids, ids per document, seconds it took)."""
    start = time.perf_counter()
    tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None:
        import ray

        from rayllm.data import tokenizer as tok

        tokenizer = _TOKENIZERS[key] = tok.load(ray.get(tokenizer_ref[0]), "of this run")
    # One core per task, so the per-task rate is a per-core rate: tokenizers reads this at each call
    # (a task has its worker process to itself while it runs; the setting is put back after).
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    lengths = np.fromiter((len(e.ids) for e in encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter((i for e in encoded for i in e.ids), dtype=np.int32, count=int(lengths.sum()))
    return ids, lengths, time.perf_counter() - start


class TaskSizer:
    """How many tokenize tasks to keep running; fed by the reader's measurements (see module doc)."""

    def __init__(self, ceiling: int, clock=time.monotonic):
        self.ceiling = max(0, ceiling)
        self.tasks = 0
        self._clock = clock
        self._start = clock()
        self._bytes = self._task_bytes = 0
        self._task_seconds = self._idle = 0.0
        self._per_task: float | None = None  # bytes per task-second, smoothed
        self._grew_from: tuple[int, float] | None = None  # (tasks, rate) before the last step up
        self._settling = False  # the period after a step: not judged
        self._saturated: tuple[int, float] | None = None  # (tasks that paid, until when)

    def tokenized(self, text_bytes: int, seconds: float) -> None:
        self._task_bytes += text_bytes
        self._task_seconds += seconds

    def taken(self, text_bytes: int) -> None:
        self._bytes += text_bytes

    def waited_for_consumer(self, seconds: float) -> None:
        self._idle += seconds

    def update(self) -> int:
        """Re-size at the end of each period; returns the number of tasks to keep running."""
        now = self._clock()
        period = now - self._start
        if period < SIZE_PERIOD_S:
            return self.tasks
        if self._task_seconds > 0:
            rate = self._task_bytes / self._task_seconds
            self._per_task = rate if self._per_task is None else 0.5 * (self._per_task + rate)
        demand = self._bytes / period
        if self._saturated is not None and now >= self._saturated[1]:
            self._saturated = None
        if self._per_task and self._idle >= IDLE_FRACTION * period:
            need = HEADROOM * demand / self._per_task
            self.tasks = 0 if need < 0.5 else min(self.ceiling, math.ceil(need))
            self._grew_from, self._settling = None, False
        elif self._per_task:
            self._bottleneck(demand, now)
        self._start, self._bytes, self._task_bytes, self._task_seconds, self._idle = now, 0, 0, 0.0, 0.0
        return self.tasks

    def _bottleneck(self, rate: float, now: float) -> None:
        """The reader is the slower side: step up while the last step raised its rate by 10%.

        A period after a step is skipped (new task workers start); a step that did not pay
        is taken back and the ceiling held there for SATURATED_HOLD_S, then probed again."""
        if self._settling:
            self._settling = False
            return
        if self._grew_from is not None:
            before_tasks, before_rate = self._grew_from
            self._grew_from = None
            if rate < 1.1 * before_rate:
                self.tasks, self._saturated = before_tasks, (before_tasks, now + SATURATED_HOLD_S)
                return
        limit = self.ceiling if self._saturated is None else self._saturated[0]
        if self.tasks < limit:
            self._grew_from, self._settling = (self.tasks, rate), True
            self.tasks = min(limit, max(2, self.tasks + max(1, self.tasks // 2)))


@dataclass
class _Job:
    texts: list[str]
    text_bytes: int
    ref: object = None  # the task's result, once submitted


class TokenizePool:
    """Tokenize tasks shared by the slots of one reading task, at most ``sizer.tasks`` at once."""

    def __init__(self, tokenizer_json: str, ceiling: int):
        import ray

        self._ray = ray
        # The same key in every process (str hashes are salted per process): one tokenizer per task worker.
        self._key = int.from_bytes(hashlib.sha1(tokenizer_json.encode()).digest()[:8], "big")
        self._tokenizer_ref = [ray.put(tokenizer_json)]  # in a list: the task fetches it once per process
        # num_cpus=0: never queued behind training workers that hold every CPU (a deadlock); the
        # sizer bounds how many run. No runtime_env of their own: they reuse the reading tasks'
        # warm worker processes instead of starting a pool apart.
        self._remote = ray.remote(_encode).options(num_cpus=0)
        self.sizer = TaskSizer(ceiling)
        self._queued: deque[_Job] = deque()  # read ahead, not yet submitted, oldest first
        self._running: set = set()

    def ahead(self) -> int:
        """Jobs a slot reads ahead: none while the reader tokenizes itself."""
        return 2 if self.sizer.tasks else 0

    def queue(self, texts: list[str]) -> _Job:
        job = _Job(texts, sum(len(t) for t in texts))
        self._queued.append(job)
        self._pump()
        return job

    def result(self, job: _Job, local_encode) -> list[np.ndarray]:
        """Token ids per document of ``job``, tokenized by a task, or here when there are none."""
        self.sizer.taken(job.text_bytes)
        if job.ref is None:
            self._queued.remove(job)
            if not self.sizer.tasks:
                start = time.perf_counter()
                ids = local_encode(job.texts)
                self.sizer.tokenized(job.text_bytes, time.perf_counter() - start)
                self._resize()
                return ids
            self._submit(job)
        ready, _ = self._ray.wait([job.ref], timeout=RESULT_TIMEOUT_S)
        if not ready:
            raise TimeoutError(
                f"a tokenize task gave no result in {RESULT_TIMEOUT_S:.0f} s (its node is lost or overloaded); "
                "the attempt restarts from its last checkpoint"
            )
        ids, lengths, seconds = self._ray.get(job.ref)
        self._running.discard(job.ref)
        self.sizer.tokenized(job.text_bytes, seconds)
        self._resize()
        return np.split(ids, np.cumsum(lengths)[:-1])

    def _resize(self) -> None:
        self.sizer.update()
        self._pump()

    def _submit(self, job: _Job) -> None:
        job.ref = self._remote.remote(self._key, self._tokenizer_ref, job.texts)
        job.texts = []  # the task holds them now
        self._running.add(job.ref)

    def _pump(self) -> None:
        """Submit read-ahead jobs, oldest first, while fewer than the sized number run."""
        if self._running:
            done, _ = self._ray.wait(list(self._running), num_returns=len(self._running), timeout=0)
            self._running.difference_update(done)
        while self._queued and len(self._running) < self.sizer.tasks:
            self._submit(self._queued.popleft())


class InProcess:
    """No pool: each job is tokenized where it is read, when it is needed (torchrun, tests)."""

    def ahead(self) -> int:
        return 0

    def queue(self, texts: list[str]) -> _Job:
        return _Job(texts, 0)

    def result(self, job: _Job, local_encode) -> list:
        return local_encode(job.texts)


def read_ahead(
    docs: Iterator[tuple[int, str]], pool: TokenizePool | InProcess, local_encode
) -> Iterator[tuple[int, np.ndarray | list[int]]]:
    """(document, token ids) in document order, tokenized through ``pool`` with jobs read ahead.

    A shard that fails gives every document read before the fault, then raises: what
    ``on_bad_shard=skip`` keeps of it must not depend on how far ahead the pool reads."""
    pending: deque[tuple[list[int], _Job]] = deque()
    fault: BaseException | None = None

    def read_job() -> bool:
        nonlocal fault
        batch, size = [], 0
        try:
            for doc, text in docs:
                batch.append((doc, text))
                size += len(text)
                if len(batch) == JOB_DOCS or size >= JOB_BYTES:
                    break
        except Exception as e:  # raised once the documents read before it are given
            fault = e
        if batch:
            pending.append(([d for d, _ in batch], pool.queue([t for _, t in batch])))
        return bool(batch) and fault is None

    more = True
    while True:
        while more and len(pending) <= pool.ahead():
            more = read_job()
        if not pending:
            if fault is not None:
                raise fault
            return
        doc_ids, job = pending.popleft()
        yield from zip(doc_ids, pool.result(job, local_encode), strict=True)
