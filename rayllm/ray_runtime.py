"""Join or start Ray, and wait (with a deadline) until the cluster has room for a run.

One job: every entry point (train, eval, prepare) reaches Ray through ``connect_ray``, and the
training driver calls ``wait_for_room`` before Ray Train, so that a cluster too small for the run
ends it with an error naming the fix instead of a silent wait for ever.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

from rayllm.config import TrainConfig
from rayllm.errors import RayllmError

POLL_S = 2.0
PROGRESS_EVERY_S = 15.0

# The Ray this process connected to through connect_ray: {"session", "address", "cpus"}; None before.
# Only a Ray recorded here is rayllm's to replace; one the user started is never touched.
_connected: dict[str, Any] | None = None


def connect_ray(config: TrainConfig) -> None:
    """Join RAY_ADDRESS / cluster.address when given, else start a local Ray on 127.0.0.1.

    A Ray that an earlier call in this process started (or joined) is replaced when this run needs
    another: a bigger local Ray for more workers, or the cluster it names. The user's own Ray stays.
    """
    global _connected
    # Keep every Ray process on loopback (see shared NOTES: Ray advertises the external IP otherwise).
    # Ray reads this when it is imported, so it is set first.
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # A local run sends nothing off the machine: no usage statistics to Ray's servers.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        if not _replace_ours(address, local_cpus(config)):
            return
        ray.shutdown()
    _connected = None
    if address:
        # Inside `ray job submit` the job's own runtime env (working dir, packages) applies.
        ray.init(address=address, log_to_driver=True)
        _connected = {"session": _session(), "address": address, "cpus": None}
        return
    num_cpus = local_cpus(config)
    ray.init(
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        include_dashboard=True,  # Ray Train's controller queries the state API it serves
        dashboard_host="127.0.0.1",
        logging_level="WARNING",
    )
    _connected = {"session": _session(), "address": None, "cpus": num_cpus}


def local_cpus(config: TrainConfig) -> float:
    """Logical CPUs for a local Ray: training workers reserve theirs, and Ray Data's tokenizer
    tasks need a little room beside them (see ``no_room_for_data``)."""
    hi = config.worker_range[1]
    return max(machine_cpus(), hi * config.cluster.cpus_per_worker + 1)


def machine_cpus() -> int:
    """This machine's cores (a function, so that a test can play a 2-core machine on a bigger one)."""
    return os.cpu_count() or 1


def _session() -> str | None:
    import ray

    return ray.get_runtime_context().get_session_name() if ray.is_initialized() else None


def _replace_ours(address: str | None, cpus: float) -> bool:
    """Whether the running Ray is one connect_ray set up that this run cannot use: another address,
    or a local Ray with too few CPUs (its workers would take every CPU and Ray Data would hang)."""
    if _connected is None or _connected["session"] != _session():
        return False  # the user's Ray (ray.init of their own): use it as it is
    if address or _connected["address"]:
        return address != _connected["address"]
    return cpus > _connected["cpus"]


def started_local_ray() -> bool:
    """Whether the running Ray is a local one connect_ray started: nothing can add nodes to it."""
    return _connected is not None and _connected["address"] is None and _connected["session"] == _session()


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


def _can_grow_by_config() -> bool:
    """The cluster config in the GCS (autoscaler state namespace) has a node group that can grow:
    the test Ray Data itself uses (ray/data/_internal/cluster_autoscaler/util.py)."""
    import ray._private.state

    config = ray._private.state.state.get_cluster_config()
    if not config:
        return False
    return any(
        group.max_count == -1 or group.max_count > group.min_count
        for group in config.node_group_configs
        if group.resources and group.max_count != 0
    )


def configured_node_types(status: dict[str, Any] | None) -> bool:
    """Whether autoscaler v1's status report names node types from an autoscaling config.

    The monitor runs on every head; without ``--autoscaling-config`` it runs a readonly provider
    (max_workers 0) that names each node's type ``node_<node id>``
    (ray/autoscaler/_private/util.py: format_readonly_node_type). Any other name, or a launch in
    flight, comes from a config whose provider can add nodes.
    """
    report = (status or {}).get("autoscaler_report") or {}
    if report.get("pending_launches") or report.get("pending_nodes"):
        return True
    mapping = report.get("node_type_mapping") or {}
    return any(kind != f"node_{node_id}" for node_id, kind in mapping.items())


def _v1_status() -> dict[str, Any] | None:
    """Autoscaler v1's last status (ray/autoscaler/_private/monitor.py, Monitor._run, writes it
    to the GCS internal KV under ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS)."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    return json.loads(raw) if raw else None


def _v2_configured() -> bool:
    """Autoscaler v2 keeps no v1 status; its cluster status names node types the same way."""
    import ray
    from ray.autoscaler._private.util import format_readonly_node_type
    from ray.autoscaler.v2.sdk import get_cluster_status
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if not is_autoscaler_v2(fetch_from_server=True):
        return False
    status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=10)
    if status.pending_launches or status.pending_nodes:
        return True
    nodes = [*status.active_nodes, *status.idle_nodes]
    return any(n.ray_node_type_name and n.ray_node_type_name != format_readonly_node_type(n.node_id) for n in nodes)


def autoscaler_running() -> bool:
    """Whether an autoscaler can add nodes to the connected cluster (asked afresh on each call:
    a new head's monitor writes its first status a few seconds after it starts)."""
    checks = (_can_grow_by_config, lambda: configured_node_types(_v1_status()), _v2_configured)
    for check in checks:
        try:
            if check():
                return True
        except Exception:
            continue  # a Ray without that piece of state: the other checks decide
    return False


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
