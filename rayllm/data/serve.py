"""The global stream served through Ray's object store, with no per-rank thread, queue or call.

One ``StreamServer`` actor per training attempt runs the source pipelines (ray_stream.py) and
the global order (order.py). Per step it puts the global batch into the object store as one
object per *node's worth* of data-parallel slices (``slices_per_object``: the data ranks of
one node), and records the references. Its clients are the nodes' relays (relay.py), not the
ranks: a relay asks for the objects of its node's ranks of every step ready after the last one
it holds. A call carries no tokens and covers every step the server is ahead by (up to 32), so
the server answers one call per node per many steps when data keeps up, and one per node per
step when it does not. The tokens go object store to object store, once per node.

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

from rayllm.data.order import DataState, StreamPlan, open_stream
from rayllm.data.ray_stream import configure_ray_data, ray_chunks

END = "end-of-stream"
REPLY_WAIT_S = 5.0  # a call with nothing ready returns empty after this, and the rank asks again


class StreamServer:
    """Produces global batches ahead of the slowest client (at most ``depth`` steps) and hands out references."""

    def __init__(
        self,
        plan: StreamPlan,
        state: dict[str, Any],
        consumed: int,
        global_batch: int,
        data_slices: int,
        slices_per_object: int,
        tokenize_tasks: int,
        depth: int | None = None,
    ):
        configure_ray_data()
        self._rows_per_slice = global_batch // data_slices
        self._slices, self._depth = data_slices, depth or MAX_DEPTH  # sized by the first batch unless given
        self._per_object = max(1, slices_per_object)
        self._sized = False  # depth fixed by the first batch's bytes
        self._steps: dict[int, tuple[list, dict]] = {}  # step of this attempt -> (object refs, data state)
        self._published = 0
        self._held: dict[str, int] = {}  # client -> steps its slowest rank has taken (written on the event loop)
        self._clients_ranks: dict[str, int] = {}  # client -> how many ranks it serves
        self._held_lock = threading.Lock()  # ... and read by the producer thread
        self._ranks = 0
        self._layouts: dict[tuple[int, ...], tuple[list[int], dict[int, tuple[int, int, int]]]] = {}
        self._done = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._news: asyncio.Event | None = None
        args = (plan, DataState.from_dict(state), consumed, global_batch, tokenize_tasks)
        threading.Thread(target=self._produce, args=args, daemon=True, name="rayllm-stream").start()

    def _produce(self, plan, state, consumed, global_batch, tokenize_tasks) -> None:
        import ray

        try:
            for rows, meta in self._stream(plan, state, consumed, global_batch, tokenize_tasks):
                if not self._sized:
                    self._depth = min(self._depth, max(MIN_DEPTH, AHEAD_BYTES // max(1, rows.nbytes)))
                    self._sized = True
                rows_per_object = self._per_object * self._rows_per_slice
                refs = [ray.put(rows[lo : lo + rows_per_object]) for lo in range(0, len(rows), rows_per_object)]
                if not self._wait_for_room():
                    return
                self._steps[self._published] = (refs, meta.to_dict())
                self._published += 1
                self._announce()
            self._done = True
        except BaseException as e:  # handed to every rank, which raises it
            self._error = e
        self._announce()

    def _stream(self, plan, state, consumed, global_batch, tokenize_tasks) -> Iterator[tuple[Any, DataState]]:
        return open_stream(plan, state, consumed=consumed, global_batch=global_batch, chunks=ray_chunks(tokenize_tasks))

    def _wait_for_room(self) -> bool:
        """Block the producer while it is ``depth`` steps ahead of the slowest rank; drop what all ranks hold."""
        while not self._stop.is_set():
            with self._held_lock:
                every_rank = self._ranks and sum(self._clients_ranks.values()) == self._ranks
                slowest = min(self._held.values()) if every_rank else 0
            for step in [s for s in self._steps if s < slowest]:
                del self._steps[step]  # the relays hold their own references until their ranks took them
            if self._published - slowest < self._depth:
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

    async def steps(self, client: str, ranks: list[int], world_size: int, fetched: int, taken: int) -> dict | str:
        """For a client serving ``ranks`` (a node's relay) whose slowest rank has taken ``taken``
        steps: the objects holding those ranks' rows of every step after the first ``fetched``
        that is ready, with where each rank's rows lie in them (``layout``: rank -> (object, lo,
        hi)); no steps after REPLY_WAIT_S with none ready, or END. Raises the stream's error."""
        if self._loop is None:
            self._loop, self._news = asyncio.get_running_loop(), asyncio.Event()
        self._ranks = world_size
        with self._held_lock:
            self._held[client] = taken
            self._clients_ranks[client] = len(ranks)
        deadline = time.monotonic() + REPLY_WAIT_S
        while self._published <= fetched:
            if self._error is not None:
                raise self._error
            if self._done:
                return END
            left = deadline - time.monotonic()
            if left <= 0:
                return {"layout": {}, "steps": []}
            try:
                await asyncio.wait_for(self._news.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass
        objects, layout = self._layout(tuple(ranks), world_size)
        ready = [self._steps[s] for s in range(fetched, self._published)]
        return {"layout": layout, "steps": [([refs[o] for o in objects], meta) for refs, meta in ready]}

    def _layout(self, ranks: tuple[int, ...], world_size: int):
        """The objects a client's ranks read from, and each rank's (index among them, lo, hi)."""
        if ranks not in self._layouts:
            where = {}
            for rank in ranks:
                data_slice = rank * self._slices // world_size
                obj, offset = divmod(data_slice, self._per_object)
                where[rank] = (obj, offset * self._rows_per_slice)
            objects = sorted({obj for obj, _ in where.values()})
            layout = {r: (objects.index(o), lo, lo + self._rows_per_slice) for r, (o, lo) in where.items()}
            self._layouts[ranks] = (objects, layout)
        return self._layouts[ranks]

    def stop(self) -> None:
        self._stop.set()


# Steps the server runs ahead of the slowest rank: up to MAX_DEPTH, within AHEAD_BYTES of the
# object store. A rank's call returns every ready step, so the deeper, the fewer calls.
MAX_DEPTH, MIN_DEPTH, AHEAD_BYTES = 32, 4, 512 << 20


def start_server(
    plan: StreamPlan,
    state: DataState,
    *,
    consumed: int,
    global_batch: int,
    data_slices: int,
    slices_per_object: int,
    tokenize_tasks: int,
    name: str,
):
    """Start the stream's actor beside the calling process (rank 0); it dies with its owner."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(StreamServer).options(
        name=name,
        num_cpus=0,
        max_concurrency=10_000,  # waiting relays are coroutines, not threads
        # The producer thread's ray.get (Ray Data) is not on the event loop: Ray's warning does not apply.
        runtime_env={"env_vars": {"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}},
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True),
    )
    return actor.remote(plan, state.to_dict(), consumed, global_batch, data_slices, slices_per_object, tokenize_tasks)


class DataStreamLost(RuntimeError):
    """The stream server or a node's relay died or stalled. Not a user error: the attempt fails
    and Ray Train restarts the run from its latest checkpoint, whose data state says where the
    new server starts."""
