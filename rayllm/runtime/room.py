"""Wait (with a deadline) until the cluster has room for a run.

The training driver calls ``wait_for_room`` before Ray Train, so that a cluster too small for the
run ends it with an error naming the fix instead of a silent wait for ever. Everything here reads
the run's TrainConfig; joining or starting Ray is ``rayllm/ray_cluster.py``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from rayllm.config import TrainConfig
from rayllm.errors import RayllmError
from rayllm.ray_cluster import autoscaler_running, started_local_ray

POLL_S = 2.0
PROGRESS_EVERY_S = 15.0


def run_cpus(config: TrainConfig) -> float:
    """Logical CPUs a run needs of a local Ray (``connect_ray``'s ``cpus``): training workers
    reserve theirs, and Ray Data's tokenizer tasks need a little room beside them (see
    ``no_room_for_data``)."""
    hi = config.worker_range[1]
    return hi * config.cluster.cpus_per_worker + 1


def worker_bundle(config: TrainConfig) -> dict[str, float]:
    """What one training worker reserves (the resources_per_worker the driver gives Ray Train)."""
    bundle = {
        "CPU": config.cluster.cpus_per_worker,
        **({"GPU": 1} if config.cluster.use_gpu else {}),
        **config.cluster.worker_resources,
    }
    return {name: float(amount) for name, amount in bundle.items() if amount}


def _workers_fitting(node: dict[str, float], bundle: dict[str, float]) -> int:
    return min(math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items())


def worker_shortage(nodes: list[dict[str, float]], config: TrainConfig) -> str | None:
    """Why the alive nodes (their total resources) cannot hold the fewest workers the run starts
    with, or None. A worker's bundle must fit on one node, as Ray Train places it."""
    bundle = worker_bundle(config)
    lo = config.worker_range[0]
    fit = sum(_workers_fitting(node, bundle) for node in nodes) if bundle else lo
    if fit >= lo:
        return None
    totals = {name: sum(node.get(name, 0.0) for node in nodes) for name in bundle}
    short = [name for name, amount in bundle.items() if totals[name] < lo * amount]
    each = ", ".join(f"{amount:g} {name}" for name, amount in bundle.items())
    if short:
        have = ", ".join(f"{totals[name]:g} of the {lo * bundle[name]:g} {name} needed" for name in short)
        reason = f"the cluster has {have}"
    else:
        reason = "no more nodes have room for a whole worker"
    return (
        f"{lo} worker(s) (cluster.num_workers) of {each} each do not fit: {reason}. "
        f"{_shortage_fix(short[0] if short else None, lo, bundle)}"
    )


def _shortage_fix(name: str | None, lo: int, bundle: dict[str, float]) -> str:
    """How to give the cluster what is short, or to ask for less of it."""
    from rayllm.data.stream.pipeline import DATA_TASK_CPUS

    if name == "CPU":
        cpus = math.ceil(lo * bundle["CPU"] + 2 * DATA_TASK_CPUS)
        return (
            f"Add nodes or give Ray more logical CPUs (ray start --num-cpus={cpus}), "
            f"or lower cluster.cpus_per_worker or cluster.num_workers."
        )
    if name == "GPU":
        return f"Add nodes with GPUs (ray start --num-gpus={lo}), or set cluster.use_gpu=false."
    if name:
        return (
            f"Start nodes that have it (ray start --resources='{{\"{name}\": {lo * bundle[name]:g}}}'), "
            f"or change cluster.worker_resources."
        )
    return "Add bigger nodes, or lower cluster.cpus_per_worker or cluster.worker_resources."


def no_room_for_data(cluster_cpus: float, config: TrainConfig) -> str | None:
    """Why training would wait for ever on a cluster of ``cluster_cpus`` CPUs, or None: the
    worker group Ray Train would start there takes every CPU, so the data pipeline's tasks can
    never run (unless an autoscaler adds nodes)."""
    from rayllm.data.stream.pipeline import DATA_TASK_CPUS

    lo, hi = config.worker_range
    per_worker = config.cluster.cpus_per_worker
    workers = min(hi, math.floor(cluster_cpus / per_worker)) if per_worker else hi
    if workers < lo or cluster_cpus - workers * per_worker >= DATA_TASK_CPUS:
        return None
    return (
        f"the cluster has {cluster_cpus:g} CPUs and {workers} worker(s) x {per_worker:g} CPU "
        f"(cluster.cpus_per_worker) take them all: the data pipeline's tasks ({DATA_TASK_CPUS:g} CPU each) "
        f"cannot run, so training would wait until the cluster grows. Give Ray more logical CPUs "
        f"(ray start --num-cpus={math.ceil(workers * per_worker + 2 * DATA_TASK_CPUS)}) or lower "
        f"cluster.cpus_per_worker."
    )


def room_problem(nodes: list[dict[str, float]], config: TrainConfig) -> str | None:
    """Why the run cannot start on these nodes (their total resources), or None."""
    cpus = sum(node.get("CPU", 0.0) for node in nodes)
    return worker_shortage(nodes, config) or no_room_for_data(cpus, config)


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(node.get("Resources") or {}) for node in ray.nodes() if node.get("Alive")]


def _request_nodes(config: TrainConfig):
    """A placement group of the fewest workers: the demand that makes an autoscaler add nodes
    (one that waits for room before Ray Train asks for any would otherwise wait for ever)."""
    from ray.util.placement_group import placement_group

    bundle = worker_bundle(config)
    if not bundle:
        return None
    return placement_group([bundle] * config.worker_range[0], strategy="PACK")


def _drop(group) -> None:
    if group is None:
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:
        pass  # the driver's placement groups go with it anyway


def wait_for_room(
    config: TrainConfig,
    log: Callable[[str], None],
    *,
    poll_s: float = POLL_S,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> None:
    """Return once the cluster can hold the run; raise a RayllmError naming the fix when it cannot
    within cluster.resource_wait_s. With an autoscaler it waits as long as nodes take to come
    (asking for them), and only the fewest workers need room: Ray Data's own demand grows the rest.
    A local Ray that connect_ray started cannot grow: it fails at once."""
    limit = 0.0 if started_local_ray() else float(config.cluster.resource_wait_s)
    started = time.monotonic()
    shown_at: float | None = None
    demand = None
    try:
        while True:
            nodes = _alive_nodes()
            problem = room_problem(nodes, config)
            if problem is None:
                return
            growing = not started_local_ray() and autoscaler_running()
            if growing and worker_shortage(nodes, config) is None:
                return  # only the data tasks lack room: their demand makes the autoscaler add nodes
            elapsed = time.monotonic() - started
            if not growing and elapsed >= limit:
                raise RayllmError(_no_room_message(problem, elapsed, limit))
            if growing and demand is None:
                demand = _request_nodes(config)
            if shown_at is None or time.monotonic() - shown_at >= progress_every_s:
                log(_progress_line(problem, elapsed, limit, growing))
                shown_at = time.monotonic()
            time.sleep(poll_s if growing else max(0.0, min(poll_s, limit - elapsed)))
    finally:
        _drop(demand)


def _progress_line(problem: str, elapsed: float, limit: float, growing: bool) -> str:
    if growing:
        return f"waiting for room: {problem} ({elapsed:.0f}s; an autoscaler is adding nodes, so no time limit)"
    return f"waiting for room: {problem} ({elapsed:.0f}s of cluster.resource_wait_s={limit:g}s)"


def _no_room_message(problem: str, elapsed: float, limit: float) -> str:
    where = "the local Ray rayllm started" if started_local_ray() else "a cluster without an autoscaler"
    waited = f" after {elapsed:.0f}s (cluster.resource_wait_s={limit:g})" if limit else ""
    return f"no room for the run on {where}{waited}: {problem}"
