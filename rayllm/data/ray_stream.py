"""The global stream on Ray: tokenized once by Ray Data, served to the ranks by position.

One ``StreamServer`` actor per training attempt runs a Ray Data pipeline per source
(read + tokenize + pack in tasks across the cluster, order preserved), mixes, shuffles
and cuts the stream into global batches (order.py), and hands rank r its slice of each
step through the object store. So each sequence is tokenized once, whatever the number
of workers, and the order is the same one the in-process path computes.

Written by hand because Ray Data's own splitting (``streaming_split``) hands out blocks
as workers ask for them: it has no resumable position and its order depends on timing
and on the number of workers (Ray issues #37633, #48224).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from rayllm.data.groups import GroupPacker, passes
from rayllm.data.order import DataState, StreamPlan, open_stream, rank_slice
from rayllm.data.source import SourcePlan

_PACKERS: dict[int, GroupPacker] = {}
_END = "end-of-stream"
OUTPUT_BLOCK_BYTES = 4 << 20


def pack_items(batch: dict[str, np.ndarray], plan: SourcePlan) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data task: one tokenizer per worker process, reused by every task it runs.

    Tasks rather than an actor pool: Ray keeps worker processes warm, so the first
    sequence arrives in about a second instead of after an actor's cold start.
    """
    key = hash((plan.tokenizer_json, plan.index))
    packer = _PACKERS.get(key)
    if packer is None or packer.plan != plan:
        packer = _PACKERS[key] = GroupPacker(plan)
    yield from packer(batch)


def _idle_throttle_class():
    """A Ray Data execution callback that sleeps while no task is in flight.

    Written by hand because Ray Data (2.60) has no such setting: its scheduling loop
    blocks in ``ray.wait`` only while tasks run. When training is the slower side, every
    task is held back by backpressure and the loop spins, taking a core and the GIL from
    the process it runs in (measured: 2.4x slower training steps on 2 cores).
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


def configure_ray_data() -> None:
    """This process's Ray Data settings: ordered output, quiet, and the idle throttle."""
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-execution lines are noise here
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    # Blocks of a few MB stream out of a task while it still reads its shard: the first
    # sequences arrive after seconds, not after a whole (possibly GB-sized) shard.
    ctx.target_max_block_size = OUTPUT_BLOCK_BYTES
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    throttle = _idle_throttle_class()
    if not any(c.__name__ == throttle.__name__ for c in ctx.custom_execution_callback_classes):
        ctx.custom_execution_callback_classes.append(throttle)


DATA_TASK_CPUS = 0.5  # what each tokenize-and-pack task of a training run reserves


def ray_chunks(parallelism: int, cpus_per_task: float = DATA_TASK_CPUS, env: dict[str, str] | None = None):
    """A chunk source (order.ChunkSource) that runs each source as Ray Data executions."""
    import ray.data

    remote_args = {"runtime_env": {"env_vars": env}} if env else {}

    def chunks(plan: SourcePlan, cursor) -> Iterator[dict[str, np.ndarray]]:
        def run_pass(groups: list[dict]) -> Iterator[dict[str, np.ndarray]]:
            ds = ray.data.from_items(groups, override_num_blocks=len(groups)).map_batches(
                pack_items,
                fn_kwargs={"plan": plan},
                batch_size=1,
                compute=ray.data.TaskPoolStrategy(size=max(1, min(parallelism, len(groups)))),
                num_cpus=cpus_per_task,
                **remote_args,
            )
            # prefetch_batches=1: a deeper prefetch holds the first block back until that many are
            # ready (measured: the first sequences came 3.5 s later with 4); order.py buffers anyway.
            yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)

        return passes(plan, cursor, run_pass)

    return chunks


class StreamServer:
    """Serves each rank its slice of each global batch, in order (a threaded Ray actor)."""

    def __init__(
        self,
        plan: StreamPlan,
        state: dict[str, Any],
        consumed: int,
        global_batch: int,
        world_size: int,
        parallelism: int,
        ranks_per_slice: int = 1,
        depth: int = 4,
    ):
        configure_ray_data()
        self._world_size = world_size
        self._ranks_per_slice = ranks_per_slice  # consecutive ranks (a TP group) fed the same slice
        self._queues = [queue.Queue(maxsize=depth) for _ in range(world_size)]
        self._error: BaseException | None = None
        self._stop = threading.Event()
        args = (plan, DataState.from_dict(state), consumed, global_batch, parallelism)
        threading.Thread(target=self._produce, args=args, daemon=True, name="rayllm-stream").start()

    def _produce(self, plan, state, consumed, global_batch, parallelism) -> None:
        try:
            stream = open_stream(
                plan, state, consumed=consumed, global_batch=global_batch, chunks=ray_chunks(parallelism)
            )
            for rows, meta in stream:
                meta_dict = meta.to_dict()
                slices = self._world_size // self._ranks_per_slice
                for rank, q in enumerate(self._queues):
                    self._put(q, (rank_slice(rows, rank // self._ranks_per_slice, slices), meta_dict))
            for q in self._queues:
                self._put(q, _END)
        except BaseException as e:  # handed to every rank, which raises it
            self._error = e

    def _put(self, q: queue.Queue, item) -> None:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def take(self, rank: int) -> list:
        """The next items for ``rank`` (at least one, all that are ready); raises the stream's error."""
        q = self._queues[rank]
        while True:
            try:
                items = [q.get(timeout=0.5)]
                break
            except queue.Empty:
                if self._error is not None:
                    raise self._error from None
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                return items

    def stop(self) -> None:
        self._stop.set()


def start_server(
    plan: StreamPlan,
    state: DataState,
    *,
    consumed: int,
    global_batch: int,
    world_size: int,
    parallelism: int,
    name: str,
    ranks_per_slice: int = 1,
):
    """Start the stream's actor beside the calling process (rank 0); it dies with its owner."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(StreamServer).options(
        name=name,
        num_cpus=0,
        max_concurrency=world_size + 4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True),
    )
    return actor.remote(plan, state.to_dict(), consumed, global_batch, world_size, parallelism, ranks_per_slice)


class DataStreamLost(RuntimeError):
    """The stream server died or stalled. Not a user error: the attempt fails and Ray Train restarts
    the run from its latest checkpoint, whose data state says where the new server starts."""


def served_batches(server, rank: int, timeout_s: float) -> Iterator[tuple[np.ndarray, DataState]]:
    """This rank's batches from the server, with the data state after each; each wait has a deadline."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    while True:
        try:
            items = ray.get(server.take.remote(rank), timeout=timeout_s)
        except RayActorError as e:
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataStreamLost(
                f"the data stream server died ({cause}); restarting from the latest checkpoint"
            ) from None
        except GetTimeoutError:
            raise DataStreamLost(
                f"rank {rank} waited {timeout_s:g} s (data.wait_timeout_s) for its next batch from the data "
                "stream server and got none: the server or its Ray Data tasks are stalled (is there a free CPU "
                "for them?); restarting from the latest checkpoint"
            ) from None
        for item in items:
            if isinstance(item, str) and item == _END:
                return
            rows, meta = item
            yield rows, DataState.from_dict(meta)
