"""The global stream served through Ray's object store, with no per-rank thread, queue or call.

One ``StreamServer`` actor per run, owned by the driver, so it outlives the training attempts:
a restart after a lost worker finds it running (and the nodes' relays, which the run's control
actor keeps). It runs the source pipelines (ray_stream.py) and
the global order (order.py). Per step it puts the global batch into the object store as one
object per *node's worth* of data-parallel slices (``slices_per_object``: the data ranks of
one node), and records the references. Its clients are the nodes' relays (relay.py), not the
ranks: a relay asks for the objects of its node's ranks of every step ready after the last one
it holds. A call carries no tokens and covers every step the server is ahead by (up to 32), so
the server answers one call per node per many steps when data keeps up, and one per node per
step when it does not. The tokens go object store to object store, once per node.

Each attempt ``begin``s at its checkpoint's position. The server keeps the last few steps its
ranks took (``keep_behind``: back to the latest checkpoint's, within KEEP_BYTES), so a restart
that resumes among them and keeps the layout is served at once from the running stream; any
other restarts the sources from the checkpoint's data state, in the warm actor.

The server is an asyncio actor: a waiting relay is a suspended coroutine, not a thread.
The arithmetic for 1,000 GPUs is in docs/data.md.

Written by hand because Ray Data's own splitting (``streaming_split``) hands out blocks as
workers ask for them: it has no resumable position and its order depends on timing and on
the number of workers (Ray issues #37633, #48224).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

from rayllm.data.order import DataSlicing, DataState, StreamSpec, open_stream
from rayllm.data.stream.pipeline import configure_ray_data, ray_chunks
from rayllm.data.stream.protocol import END, REPLY_WAIT_S, RESTART, DataStreamLost
from rayllm.ray_cluster import pinned_actor


class _Production:
    """One run of the sources from a position: its steps by index, ``start`` sequences in."""

    def __init__(self, start: int, rows_per_object: int, depth: int):
        self.start, self.rows_per_object, self.depth = start, rows_per_object, depth
        self.steps: dict[int, tuple[list, dict]] = {}  # index -> (object refs, data state after it)
        self.published = 0
        self.sized = False  # depth fixed by the first batch's bytes
        self.keep = 0  # steps kept behind the slowest rank, within KEEP_BYTES
        self.done = False
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def index_of(self, consumed: int, global_batch: int) -> int | None:
        """The index of the step starting ``consumed`` sequences in, if it is held or next."""
        ahead, partial = divmod(consumed - self.start, global_batch)
        lowest = min(self.steps, default=self.published)
        return ahead if not partial and lowest <= ahead <= self.published else None


class StreamServer:
    """Produces global batches ahead of the slowest client (at most ``depth`` steps) and hands out references."""

    def __init__(self, global_batch: int, tokenize_tasks: int, keep_behind: int = 0, depth=None):
        # Plain arguments only: Ray restarts an actor by running its constructor again, which the plan
        # (a tokenizer of megabytes, sealed credentials: in the object store) may not survive
        # (ray-project/ray#53727). Each attempt's ``begin`` hands the plan over instead.
        configure_ray_data()
        self._plan: StreamSpec | None = None
        self._global_batch, self._tokenize_tasks = global_batch, tokenize_tasks
        self._keep_behind, self._depth = keep_behind, depth or MAX_DEPTH  # sized by the first batch unless given
        self._lock = threading.Lock()  # the producer thread and the event loop share what follows
        self._production: _Production | None = None
        self._attempt: int | None = None
        self._offset = 0  # the production's index of this attempt's first step
        self._held: dict[str, int] = {}  # client -> steps its slowest rank has taken this attempt
        self._clients_ranks: dict[str, int] = {}  # client -> how many ranks it serves
        self._ranks = 0
        self._rows_per_slice, self._slicing, self._per_object = global_batch, DataSlicing(1), 1
        self._layouts: dict[tuple[int, ...], tuple[list[int], dict[int, tuple[int, int, int]]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._news: asyncio.Event | None = None

    async def begin(
        self,
        attempt: int,
        state: dict,
        consumed: int,
        slicing: DataSlicing,
        slices_per_object: int,
        plan: StreamSpec | None = None,
    ) -> bool:
        """Serve ``attempt`` from ``consumed`` sequences in (``state``: the checkpoint's data state) of
        ``plan`` (the run's, the same at every attempt). Returns whether the running stream was kept
        (else the sources restart from ``state``)."""
        if plan is not None:
            self._plan = plan
        if self._loop is None:
            self._loop, self._news = asyncio.get_running_loop(), asyncio.Event()
        rows_per_slice = self._global_batch // slicing.slices
        per_object = max(1, slices_per_object)
        with self._lock:
            production = self._production
            index = None
            if production is not None and production.error is None:
                if production.rows_per_object == per_object * rows_per_slice:
                    index = production.index_of(consumed, self._global_batch)
            self._attempt, self._ranks = attempt, slicing.world_size
            self._rows_per_slice, self._slicing, self._per_object = rows_per_slice, slicing, per_object
            self._held, self._clients_ranks, self._layouts = {}, {}, {}
            if index is not None:
                self._offset = index
                return True
            if production is not None:
                production.stop.set()
                production.steps.clear()
            production = self._production = _Production(consumed, per_object * rows_per_slice, self._depth)
            self._offset = 0
        args = (production, DataState.from_dict(state), consumed)
        threading.Thread(target=self._produce, args=args, daemon=True, name="rayllm-stream").start()
        return False

    def _produce(self, production: _Production, state: DataState, consumed: int) -> None:
        import ray

        try:
            for rows, meta in self._stream(state, consumed):
                if production.stop.is_set():
                    return
                if not production.sized:
                    production.depth = min(production.depth, max(MIN_DEPTH, AHEAD_BYTES // max(1, rows.nbytes)))
                    production.keep = min(self._keep_behind, KEEP_BYTES // max(1, rows.nbytes))
                    production.sized = True
                size = production.rows_per_object
                refs = [ray.put(rows[lo : lo + size]) for lo in range(0, len(rows), size)]
                if not self._wait_for_room(production):
                    return
                with self._lock:
                    production.steps[production.published] = (refs, meta.to_dict())
                    production.published += 1
                self._announce()
            production.done = True
        except BaseException as e:  # handed to every rank, which raises it
            production.error = e
        self._announce()

    def _stream(self, state: DataState, consumed: int) -> Iterator[tuple[Any, DataState]]:
        chunks = ray_chunks(self._tokenize_tasks)
        return open_stream(self._plan, state, consumed=consumed, global_batch=self._global_batch, chunks=chunks)

    def _wait_for_room(self, production: _Production) -> bool:
        """Block the producer while it is ``depth`` steps ahead of the slowest rank; drop the steps
        every rank holds, but for the last ``keep`` (a restart may resume among them)."""
        while not production.stop.is_set():
            with self._lock:
                every_rank = self._ranks and sum(self._clients_ranks.values()) == self._ranks
                slowest = self._offset + (min(self._held.values()) if every_rank else 0)
                for index in [i for i in production.steps if i < slowest - production.keep]:
                    del production.steps[index]  # the relays hold their own references until their ranks took them
                if production.published - slowest < production.depth:
                    return True
            time.sleep(0.005)
        return False

    def _announce(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        news, self._news = self._news, asyncio.Event()
        news.set()

    async def steps(self, attempt: int, client: str, ranks: list[int], fetched: int, taken: int) -> dict | str:
        """For a client serving ``ranks`` (a node's relay) whose slowest rank has taken ``taken``
        steps: the objects holding those ranks' rows of every step after the first ``fetched``
        that is ready, with where each rank's rows lie in them (``layout``: rank -> (object, lo,
        hi)); no steps after REPLY_WAIT_S with none ready, or END. Raises the stream's error."""
        if attempt != self._attempt:
            if self._attempt is None:  # Ray restarted this actor: its process had died
                raise DataStreamLost(f"the data stream server died and was restarted empty; {RESTART}")
            raise DataStreamLost(f"attempt {attempt}'s data stream was taken over by attempt {self._attempt}")
        with self._lock:
            self._held[client] = taken
            self._clients_ranks[client] = len(ranks)
        production, offset = self._production, self._offset
        deadline = time.monotonic() + REPLY_WAIT_S
        while production.published - offset <= fetched:
            if production.error is not None:
                raise production.error
            if production.done:
                return END
            left = deadline - time.monotonic()
            if left <= 0:
                return {"layout": {}, "steps": []}
            try:
                await asyncio.wait_for(self._news.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass
        objects, layout = self._layout(tuple(ranks))
        with self._lock:
            ready = [production.steps[offset + s] for s in range(fetched, production.published - offset)]
        return {"layout": layout, "steps": [([refs[o] for o in objects], meta) for refs, meta in ready]}

    def _layout(self, ranks: tuple[int, ...]):
        """The objects a client's ranks read from, and each rank's (index among them, lo, hi)."""
        if ranks not in self._layouts:
            where = {}
            for rank in ranks:
                data_slice = self._slicing.slice_of(rank)
                obj, offset = divmod(data_slice, self._per_object)
                where[rank] = (obj, offset * self._rows_per_slice)
            objects = sorted({obj for obj, _ in where.values()})
            layout = {r: (objects.index(o), lo, lo + self._rows_per_slice) for r, (o, lo) in where.items()}
            self._layouts[ranks] = (objects, layout)
        return self._layouts[ranks]


# Steps the server runs ahead of the slowest rank: up to MAX_DEPTH, within AHEAD_BYTES of the
# object store. A rank's call returns every ready step, so the deeper, the fewer calls.
# Steps kept behind it for restarts: up to keep_behind, within KEEP_BYTES.
MAX_DEPTH, MIN_DEPTH, AHEAD_BYTES, KEEP_BYTES = 32, 4, 512 << 20, 256 << 20


def start_server(*, global_batch: int, tokenize_tasks: int, keep_behind: int):
    """The run's stream actor, on the caller's node (the driver's), owned by the driver: it
    outlives every attempt, and Ray restarts it (empty) if its process dies. Each attempt's rank 0
    begins it with the run's plan."""
    actor = pinned_actor(
        StreamServer,
        max_restarts=-1,  # the next attempt's begin() hands it the plan and restarts its sources
        max_concurrency=10_000,  # waiting relays are coroutines, not threads
        # The producer thread's ray.get (Ray Data) is not on the event loop: Ray's warning does not apply.
        runtime_env={"env_vars": {"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}},
    )
    return actor.remote(global_batch, tokenize_tasks, keep_behind)
