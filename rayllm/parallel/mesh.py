"""The DeviceMesh of a layout: five named axes, (pp, dp_replicate, dp_shard, cp, tp), always.

Size-1 axes cost nothing and keep one code path for every layout: FSDP takes the
data-parallel sub-mesh (2-D, replicate x shard, is HSDP), with the CP ranks folded into its
shard axis (each holds a part of every sequence, so their gradients are averaged like data
parallelism's); TP takes the "tp" axis, context parallelism's ring runs over "cp", and the
pipeline's stages send to each other over the "pp" axis's group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rayllm.parallel.layout import Layout

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Collective: the run's mesh over the default process group (ranks row-major over AXES)."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"layout {layout} needs {layout.world_size} ranks, the process group has {dist.get_world_size()}"
        )
    shape = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=AXES)


def dp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """What FSDP shards over: (replicate, shard) for HSDP, else the shard axis alone; under CP the
    shard axis is dp_shard x cp, flattened."""
    shard = "dp_shard"
    if layout.cp > 1:
        shard = "dp_shard_cp"
        if shard not in (mesh.mesh_dim_names or ()):
            mesh["dp_shard", "cp"]._flatten(shard)  # registered on the whole mesh, by name
    return mesh["dp_replicate", shard] if layout.dp_replicate > 1 else mesh[shard]


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["cp"]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["tp"]


def pp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks of one pipeline replica, one per stage (the same data-parallel and TP place)."""
    return mesh.get_group("pp")
