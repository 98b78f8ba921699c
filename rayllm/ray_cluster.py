"""Join or start Ray, tell whether the cluster can grow, and pin zero-CPU actors to nodes.

The bottom of the Ray side: every room that uses Ray (runtime, data, checkpoint, prepare, use)
may import it, so it imports no other part of rayllm, and Ray itself only inside its functions
(``connect_ray`` sets Ray's environment before Ray is imported). Every entry point (train, eval,
prepare) reaches Ray through ``connect_ray``; what a training run needs of the cluster (room for
its workers, and the wait for it) is the driver's: ``rayllm/runtime/room.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any

# The Ray this process connected to through connect_ray: {"session", "address", "cpus"}; None before.
# Only a Ray recorded here is rayllm's to replace; one the user started is never touched.
_connected: dict[str, Any] | None = None


def connect_ray(address: str | None, cpus: float) -> None:
    """Join ``address`` (else RAY_ADDRESS) when given, else start a local Ray on 127.0.0.1 with
    ``cpus`` logical CPUs (what the work needs), or this machine's cores when it has more.

    A Ray that an earlier call in this process started (or joined) is replaced when this run needs
    another: a bigger local Ray for more workers, or the cluster it names. The user's own Ray stays.
    """
    global _connected
    # Keep every Ray process on loopback (see shared NOTES: Ray advertises the external IP otherwise).
    # Ray reads this when it is imported, so it is set first.
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # A local run sends nothing off the machine: no usage statistics to Ray's servers.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    num_cpus = max(machine_cpus(), cpus)
    if ray.is_initialized():
        if not _replace_ours(address, num_cpus):
            return
        ray.shutdown()
    _connected = None
    if address:
        # Inside `ray job submit` the job's own runtime env (working dir, packages) applies.
        ray.init(address=address, log_to_driver=True)
        _connected = {"session": _session(), "address": address, "cpus": None}
        return
    ray.init(
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        include_dashboard=True,  # Ray Train's controller queries the state API it serves
        dashboard_host="127.0.0.1",
        logging_level="WARNING",
        _system_config={"worker_maximum_startup_concurrency": startup_concurrency(num_cpus)},
    )
    _connected = {"session": _session(), "address": None, "cpus": num_cpus}


# The raylet warns once its Python worker processes (started or running) reach 4x its expected
# startup concurrency, max(CPUs, worker_maximum_startup_concurrency) (raylet/worker_pool.cc): 8 on
# a 2-core machine. A run has about a dozen there at once, most of them zero-CPU and so not bounded
# by the CPUs: the driver's actors (control, stream server, record queue, a relay and a keeper per
# node), Ray Train's controller and preemption watcher, a training worker per CPU, and Ray Data's
# reading and tokenize tasks. Starting up to this many at once keeps the warning for a real excess.
LOCAL_STARTUP_CONCURRENCY = 8


def startup_concurrency(cpus: float) -> int:
    """How many worker processes rayllm's local Ray starts at once (its warning comes at 4x)."""
    return max(int(cpus), LOCAL_STARTUP_CONCURRENCY)


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


def node_affinity(node_id: str | None = None):
    """A hard scheduling strategy onto ``node_id`` (None: this process's node).

    Hard: with soft=True Ray placed such actors on other nodes (seen on a 3-node cluster), and a
    node lost then took them along.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id or ray.get_runtime_context().get_node_id(), soft=False)


def pinned_actor(cls: type, node_id: str | None = None, **options: Any):
    """``cls`` as a zero-CPU Ray actor class pinned to ``node_id`` (None: this process's node),
    with Ray's other actor ``options`` (name, max_restarts, max_concurrency, ...); call
    ``.remote(...)`` on it to start one."""
    import ray

    return ray.remote(cls).options(num_cpus=0, scheduling_strategy=node_affinity(node_id), **options)


# --- whether an autoscaler can add nodes ------------------------------------------------------


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
