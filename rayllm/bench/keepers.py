"""``python -m rayllm.bench.keepers``: how fast in-memory checkpoint files reach the keepers
(rayllm.checkpoint.memory), against the floor the object store sets, side by side in one run.

On a two-node ``ray.cluster_utils.Cluster`` of this machine, ``--writers`` tasks on one node
each write a ``--mb`` file at once, as a node's ranks write their DCP shards:

- keepers: through ``rayllm-mem://`` (the file held by this node's keeper and copied to the
  other node's);
- floor: the same bytes put into the object store once and fetched once on the other node,
  which any scheme that keeps a copy on a second node must do at least.

It prints each side's seconds and their ratio (keepers / floor).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import numpy as np


def _write_through_keepers(uri: str, mb: int) -> float:
    import fsspec

    from rayllm.checkpoint import memory

    memory.register()
    data = np.random.default_rng(0).integers(0, 255, mb * 2**20, dtype=np.uint8)  # (bytes,)
    start = time.perf_counter()
    with fsspec.open(uri, "wb") as f:
        f.write(memoryview(data))
    return time.perf_counter() - start


def _floor(mb: int, other_node: str) -> float:
    import ray

    from rayllm.ray_cluster import node_affinity

    data = np.random.default_rng(0).integers(0, 255, mb * 2**20, dtype=np.uint8)  # (bytes,)
    start = time.perf_counter()
    ref = ray.put(data)
    fetch = ray.remote(lambda refs: int(ray.get(refs[0]).nbytes)).options(
        num_cpus=0, scheduling_strategy=node_affinity(other_node)
    )
    ray.get(fetch.remote([ref]))
    return time.perf_counter() - start


def run(writers: int, mb: int, rounds: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from rayllm.checkpoint import memory
    from rayllm.ray_cluster import node_affinity

    store = max(4 * writers * mb * 2**20, 512 * 2**20)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": writers, "object_store_memory": store, "include_dashboard": False},
    )
    try:
        other = cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address, logging_level="ERROR")
        head = ray.get_runtime_context().get_node_id()
        name = f"rayllm-bench-keepers-{uuid.uuid4().hex[:6]}"
        registry = memory.start_registry(name)
        ray.get(registry.keeper.remote(other.node_id))  # both keepers up before the clock
        on_head = {"num_cpus": 1, "scheduling_strategy": node_affinity(head)}
        keepers_task = ray.remote(_write_through_keepers).options(**on_head)
        floor_task = ray.remote(_floor).options(**on_head)
        sides: dict[str, list[float]] = {"keepers": [], "floor": []}
        for r in range(rounds + 1):  # the first round warms workers and keepers: not counted
            uris = [memory.memory_uri(name, f"round{r}/rank{w}.distcp") for w in range(writers)]
            start = time.perf_counter()
            ray.get([keepers_task.remote(uri, mb) for uri in uris])
            keepers = time.perf_counter() - start
            start = time.perf_counter()
            ray.get([floor_task.remote(mb, other.node_id) for _ in range(writers)])
            floor = time.perf_counter() - start
            if r:
                sides["keepers"].append(keepers)
                sides["floor"].append(floor)
        best = {side: min(times) for side, times in sides.items()}
        return {
            "writers": writers,
            "mb_per_writer": mb,
            "seconds": best,
            "ratio_keepers_over_floor": best["keepers"] / best["floor"],
            "gb_per_s_keepers": writers * mb / 1024 / best["keepers"],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayllm.bench.keepers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=4, help="ranks writing at once on one node")
    parser.add_argument("--mb", type=int, default=64, help="MB each writes")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds; the best is kept")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    result = run(args.writers, args.mb, args.rounds)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
