"""The DeviceMesh of a layout: four named axes, (pp, dp_replicate, dp_shard, tp), always.

Size-1 axes cost nothing and keep one code path for every layout: FSDP takes the
data-parallel sub-mesh (2-D, replicate x shard, is HSDP), TP takes the "tp" axis, and the
pipeline's stages send to each other over the "pp" axis's group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rayllm.parallel.layout import Layout

AXES = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Collective: the run's mesh over the default process group (ranks row-major over AXES)."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"layout {layout} needs {layout.world_size} ranks, the process group has {dist.get_world_size()}"
        )
    shape = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=AXES)


def dp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """What FSDP shards over: (replicate, shard) for HSDP, else the shard axis alone."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["tp"]


def pp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks of one pipeline replica, one per stage (the same data-parallel and TP place)."""
    return mesh.get_group("pp")
