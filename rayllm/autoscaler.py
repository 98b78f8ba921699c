"""Spot first, on-demand when spot capacity runs out: a node-type scorer for Ray's autoscaler.

For each pending resource request Ray's autoscaler (v1, what launcher and KubeRay clusters run
by default in Ray 2.60) launches the node type with the best utilisation score. A spot type and
an on-demand type of the same machine score the same, so which of them launches is arbitrary,
and a spot pool out of capacity keeps being asked. Ray records each failed launch for
``AUTOSCALER_NODE_AVAILABILITY_MAX_STALENESS_S`` (30 minutes) but its default scorer ignores
that record. This one keeps Ray's score and orders by, in turn:

1. Ray's own first criterion (no GPU node for requests that need no GPU);
2. node types whose last launch did not fail (or that were not tried lately);
3. spot types (named ``...spot``) before the others;
4. the rest of Ray's score.

Ray offers the hook, not the policy: point the head at it with
``RAY_AUTOSCALER_UTILIZATION_SCORER=rayllm.autoscaler.spot_first`` (cluster/aws.yaml does).
"""

from __future__ import annotations

from typing import Any


def is_spot(node_type: str) -> bool:
    return node_type.lower().replace("-", "_").endswith("spot")


def spot_first(
    node_resources: dict[str, float],
    resources: list[dict[str, float]],
    node_type: str,
    *,
    node_availability_summary: Any,
) -> tuple | None:
    """Ray's utilisation score for ``node_type``, with availability and spot put first."""
    from ray.autoscaler._private.resource_demand_scheduler import _resource_based_utilization_scorer

    score = _resource_based_utilization_scorer(
        node_resources, resources, node_availability_summary=node_availability_summary
    )
    if score is None:
        return None
    record = node_availability_summary.node_availabilities.get(node_type)
    available = record is None or record.is_available
    gpu_ok, *rest = score
    return (gpu_ok, available, is_spot(node_type), *rest)
