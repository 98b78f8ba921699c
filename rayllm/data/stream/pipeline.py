"""The sources on Ray: a Ray Data pipeline per source reads, tokenizes and packs groups of
shards in tasks across the cluster, in order, so each sequence is tokenized once whatever
the number of workers, and the rows are the ones the in-process path computes.
server.py mixes them into the global order and serves it to the ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np

from rayllm.data.encode import TokenizePool
from rayllm.data.shard_groups import GroupPacker, passes
from rayllm.data.source import SourceSpec

_PACKERS: dict[int, GroupPacker] = {}
OUTPUT_BLOCK_BYTES = 4 << 20


def pack_items(batch: dict[str, np.ndarray], plan: SourceSpec, tokenize_tasks: int) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data task: one tokenizer and one tokenize pool per worker process, reused by every
    task it runs (the pool keeps what it measured).

    Tasks rather than an actor pool: Ray keeps worker processes warm, so the first
    sequence arrives in about a second instead of after an actor's cold start.
    """
    key = hash((plan.tokenizer_json, plan.index, tokenize_tasks))
    packer = _PACKERS.get(key)
    if packer is None or packer.plan != plan:
        pool = TokenizePool(plan.tokenizer_json, tokenize_tasks) if tokenize_tasks else None
        packer = _PACKERS[key] = GroupPacker(plan, pool)
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


DATA_TASK_CPUS = 0.5  # what each reading task of a training run reserves
GROUPS_IN_FLIGHT = 2  # groups a source reads at once: the next one starts while the current one drains


def ray_chunks(tokenize_tasks: int, cpus_per_task: float = DATA_TASK_CPUS, env: dict[str, str] | None = None):
    """A chunk source (order.ChunkSource) that runs each source as Ray Data executions; each
    reading task tokenizes in up to ``tokenize_tasks`` Ray tasks, as many as the run needs (encode.py)."""
    import ray.data

    remote_args = {"runtime_env": {"env_vars": env}} if env else {}

    def chunks(plan: SourceSpec, cursor) -> Iterator[dict[str, np.ndarray]]:
        def run_pass(groups: list[dict]) -> Iterator[dict[str, np.ndarray]]:
            ds = ray.data.from_items(groups, override_num_blocks=len(groups)).map_batches(
                pack_items,
                fn_kwargs={"plan": plan, "tokenize_tasks": tokenize_tasks},
                batch_size=1,
                compute=ray.data.TaskPoolStrategy(size=max(1, min(GROUPS_IN_FLIGHT, len(groups)))),
                num_cpus=cpus_per_task,
                **remote_args,
            )
            # prefetch_batches=1: a deeper prefetch holds the first block back until that many are
            # ready (measured: the first sequences came 3.5 s later with 4); order.py buffers anyway.
            yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)

        return passes(plan, cursor, run_pass)

    return chunks
