"""``rayllm bench serve``: the stream server against the single-actor design it replaced, side by side.

Simulated ranks take their slice of every step as fast as they can, from pre-tokenised
shards the bench writes (so tokenizing does not hide serving). Ranks are asyncio tasks
spread over a few consumer processes, as many ranks share a node. For each rank count it
prints served tokens/s and the p50/p99 time a rank waits for its slice, for:

- ``per-rank queues`` (the design before issue 18): one threaded actor, one queue and one
  thread per rank, one call per rank per step carrying the rank's tokens;
- ``object store`` (issue 18's first step): the stream server (data/stream/server.py) puts one object
  per node's worth of slices and hands out references for every ready step in one call, each
  rank asking it for itself;
- ``node relays`` (data/stream/relay.py, what training uses): the same server, asked once per node by
  the node's relay, which answers the node's ranks.

Relays run inside the consumer processes beside their node's ranks (a Ray actor each in
training): the hop from a rank to its relay stays on its node and does not load the server.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from rayllm.data.order import DataSlicing, DataState, StreamSpec, open_stream, rank_slice
from rayllm.data.source import RECORD_DTYPE_FIELDS, SourceSpec
from rayllm.io.settings import StorageSettings

RANKS = (1, 8, 64, 256, 1024)
PER_NODE = 8  # ranks per simulated node (GPUs per host)
# The server runs at most this many steps ahead here (a run's goes up to 32): the timed steps are
# then served while timed, not replayed from what the first call fetched, as in a data-bound run.
SERVER_DEPTH = 4
DESIGNS = ("per-rank queues", "object store", "node relays")
FETCH_TIMEOUT_S = 120  # no wait in the bench is unbounded
SEQ_LEN = 2048


def write_token_shards(root: Path, shards: int, tokens_per_shard: int, seq_len: int) -> list[str]:
    """Pre-tokenised parquet shards (a ``tokens`` column of documents of about seq_len tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    paths = []
    for s in range(shards):
        docs = tokens_per_shard // seq_len
        ids = rng.integers(1, 1000, size=(docs, seq_len), dtype=np.int32)
        offsets = pa.array(np.arange(0, ids.size + 1, seq_len, dtype=np.int32))
        table = pa.table({"tokens": pa.ListArray.from_arrays(offsets, pa.array(ids.ravel()))})
        path = root / f"part-{s:04d}.parquet"
        pq.write_table(table, path)
        paths.append(str(path))
    return paths


def _tokenizer_json() -> str:
    from rayllm.data import tokenizer as tok

    return tok.train_bpe(["alpha beta gamma delta"] * 8, 300).to_str()


def _stream(plan: StreamSpec | int, global_batch: int, parallelism: int):
    """The global batches a server serves: the plan's (pre-tokenised shards through Ray Data and
    the global order), or for a sequence length one batch over and over (serving alone)."""
    if isinstance(plan, StreamSpec):
        from rayllm.data.stream.pipeline import ray_chunks

        return open_stream(plan, DataState(), consumed=0, global_batch=global_batch, chunks=ray_chunks(parallelism))
    rows = np.zeros(global_batch, dtype=[("tokens", np.int32, (plan + 1,)), *RECORD_DTYPE_FIELDS])
    return itertools.repeat((rows, DataState()))


def _seq_len(plan: StreamSpec | int) -> int:
    return plan.sources[0].seq_len if isinstance(plan, StreamSpec) else plan


class PerRankQueues:
    """The design before issue 18, kept here as the baseline: a thread and a queue per rank."""

    def __init__(self, plan, global_batch: int, world_size: int, parallelism: int, depth: int = 4):
        from rayllm.data.stream.pipeline import configure_ray_data

        configure_ray_data()
        self._queues = [queue.Queue(maxsize=depth) for _ in range(world_size)]
        self.produced = 0

        def produce():
            for rows, meta in _stream(plan, global_batch, parallelism):
                for rank, q in enumerate(self._queues):
                    q.put((rank_slice(rows, rank, world_size), meta.to_dict()))
                self.produced += 1

        threading.Thread(target=produce, daemon=True).start()

    def counters(self) -> tuple[float, int]:
        """CPU seconds of this process (all threads) and steps produced."""
        return time.process_time(), self.produced

    def take(self, rank: int) -> list:
        items = [self._queues[rank].get()]
        while True:
            try:
                items.append(self._queues[rank].get_nowait())
            except queue.Empty:
                return items


def _object_store_server():
    from rayllm.data.stream.server import StreamServer

    class BenchStreamServer(StreamServer):
        def _stream(self, state, consumed):
            return _stream(self._plan, self._global_batch, self._tokenize_tasks)

        async def counters(self) -> tuple[float, int]:
            return time.process_time(), self._production.published

    return BenchStreamServer


class Consumer:
    """Simulated ranks (asyncio tasks) that take their slices as fast as they can: what is ready
    at first untimed (actors and pipelines starting), then timed up to step ``1 + steps``."""

    async def run(self, server, design: str, ranks: list[int], world: int, steps: int, per_node: int) -> dict[str, Any]:
        from rayllm.data.stream.relay import NodeRelay

        # A relay per node (``node relays``) or per rank (``object store``: every rank asks the server).
        group = per_node if design == "node relays" else 1
        relays = {}
        for rank in ranks:
            if rank // group not in relays:
                relays[rank // group] = NodeRelay(f"node-{rank // group}")
                await relays[rank // group].attach(server)
        waits: list[float] = []
        tokens = 0
        warm = asyncio.Event()
        warmed = 0

        pulled: dict[bytes, asyncio.Future] = {}  # object -> its fetch, shared by this process's ranks

        def pull(ref) -> asyncio.Future:
            # One fetch per object per process, as a node pulls each object once: a thousand ranks
            # awaiting the same references at once once left one await hanging (Ray 2.60).
            if ref.binary() not in pulled:
                pulled[ref.binary()] = asyncio.ensure_future(asyncio.wait_for(ref, timeout=FETCH_TIMEOUT_S))
            return pulled[ref.binary()]

        async def fetch(rank: int, held: int) -> list:
            if design == "per-rank queues":
                return [rows for rows, _ in await server.take.remote(rank)]
            node = rank // group
            reply = await relays[node].steps(1, min(group, world - node * group), rank, held)
            objects = await asyncio.gather(*(asyncio.shield(pull(ref)) for ref, *_ in reply))
            return [obj[lo:hi] for obj, (_, lo, hi, _) in zip(objects, reply, strict=True)]

        async def rank_loop(rank: int) -> None:
            nonlocal tokens, warmed
            held = 0
            try:
                while held < 1:
                    held = min(1, len(await fetch(rank, 0)))  # the rest is asked for again
            finally:  # a failed rank must not leave the others waiting
                warmed += 1
                if warmed == len(ranks):
                    warm.set()
            await warm.wait()
            # One end for all: a rank that stopped early would pin the server's window, since the
            # server frees a step only when every rank has asked past it.
            end = 1 + steps
            while held < end:
                asked = time.perf_counter()
                slices = (await fetch(rank, held))[: end - held]
                # The wait for the first step of a reply; the rest of it came with no wait of its own.
                waits.extend([time.perf_counter() - asked] + [0.0] * (len(slices) - 1))
                tokens += sum(rows["tokens"].size for rows in slices)
                held += len(slices)

        tasks = [asyncio.ensure_future(rank_loop(r)) for r in ranks]
        await asyncio.wait_for(warm.wait(), timeout=600)
        started = time.perf_counter()
        calls_before = sum(r.server_calls for r in relays.values())
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - started
        calls = sum(r.server_calls for r in relays.values()) - calls_before
        return {"waits": waits, "tokens": tokens, "seconds": seconds, "server_calls": calls}


def _one(design: str, plan: StreamSpec | int, world: int, steps: int, consumers: int, parallelism: int) -> dict:
    import ray

    global_batch = max(world, 256)
    per_node = min(PER_NODE, world)
    if design == "per-rank queues":
        server = (
            ray.remote(PerRankQueues)
            .options(num_cpus=0, max_concurrency=world + 4)
            .remote(plan, global_batch, world, parallelism)
        )
    else:
        server = (
            ray.remote(_object_store_server())
            .options(num_cpus=0, max_concurrency=10_000)
            .remote(global_batch, parallelism, 0, SERVER_DEPTH)
        )
        ray.get(server.begin.remote(1, DataState().to_dict(), 0, DataSlicing(world), per_node, plan), timeout=120)
    # Whole nodes per consumer process, as a node's ranks share its relay.
    nodes = [list(range(n, min(world, n + per_node))) for n in range(0, world, per_node)]
    actors = [ray.remote(Consumer).options(num_cpus=0).remote() for _ in range(min(consumers, len(nodes)))]
    ranks = [sum(nodes[i :: len(actors)], []) for i in range(len(actors))]
    cpu, produced = ray.get(server.counters.remote())
    runs = [a.run.remote(server, design, r, world, steps, per_node) for a, r in zip(actors, ranks, strict=True)]
    results = ray.get(runs)
    cpu_end, produced_end = ray.get(server.counters.remote())
    per_step = (cpu_end - cpu) / max(1, produced_end - produced)  # the server's CPU (all threads) per step
    for a in [*actors, server]:
        ray.kill(a)
    served, expected = sum(r["tokens"] for r in results), steps * global_batch * (_seq_len(plan) + 1)
    if served != expected:  # every rank takes its whole slice of each timed step
        raise RuntimeError(f"{design}: served {served} tokens in {steps} steps, expected {expected}")
    waits = sorted(w for r in results for w in r["waits"])
    seconds = max(r["seconds"] for r in results)
    return {
        "design": design,
        "source": "shards" if isinstance(plan, StreamSpec) else "memory",
        "ranks": world,
        "tokens_per_s": served / seconds,
        "p50_ms": 1000 * statistics.median(waits),
        "p99_ms": 1000 * waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "calls": sum(1 for w in waits if w > 0),
        "server_calls": sum(r.get("server_calls", 0) for r in results) if design != "per-rank queues" else None,
        "server_cpu_ms_per_step": 1000 * per_step,
        "steps": steps,
    }


def run(
    ranks: tuple[int, ...] = RANKS,
    seq_len: int = SEQ_LEN,
    steps: int = 20,
    consumers: int = 4,
    parallelism: int = 2,
    cpus: int | None = None,
    sources: tuple[str, ...] = ("memory", "shards"),
) -> list[dict]:
    """Each design at each rank count, serving one batch over and over (``memory``: serving
    alone) and from pre-tokenised shards (``shards``: with the pipeline that feeds it)."""
    import ray

    root = Path(tempfile.mkdtemp(prefix="rayllm-bench-serve-"))
    needed = max(max(ranks), 256) * (steps + 40) * (seq_len + 1)  # each design reads from the start
    shards = write_token_shards(root, 32, needed // 32 + seq_len * 4, seq_len)
    source = SourceSpec(
        name="bench",
        shards=shards,
        weight=1.0,
        text_field="text",
        storage=StorageSettings(),
        tokenizer_json=_tokenizer_json(),
        seq_len=seq_len,
        seed=0,
        mix=32,
        sizes=[os.path.getsize(s) for s in shards],
        epochs_per_pass=2,
    )
    plan = StreamSpec(sources=[source], window=1, seed=0)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 (shared NOTES)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=cpus or os.cpu_count() or 2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        logging_level="WARNING",
    )
    rows = []
    try:
        for source in sources:
            for world in ranks:
                for design in DESIGNS:
                    served = plan if source == "shards" else seq_len
                    rows.append(_one(design, served, world, steps, consumers, parallelism))
                    print(_line(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    return rows


def _line(r: dict) -> str:
    # The baseline's ranks call its actor directly: each rank call is a server call.
    calls = r["calls"] if r["server_calls"] is None else r["server_calls"]
    server_calls = f"{calls / r['steps']:.1f}"
    return (
        f"{r['source']:<7}{r['ranks']:>5} ranks  {r['design']:<16} {r['tokens_per_s'] / 1e6:8.2f} M tokens/s  "
        f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  {r['calls'] / r['steps']:6.1f} rank calls/step  "
        f"{server_calls:>5} server calls/step  server CPU {r['server_cpu_ms_per_step']:6.1f} ms/step"
    )
