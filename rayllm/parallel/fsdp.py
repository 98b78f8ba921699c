"""FSDP2 over the data-parallel mesh (1-D: FSDP; 2-D replicate x shard: HSDP), and the
gradient-sync rule for accumulation that keeps gradients sharded."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, dtype: torch.dtype, cpu_offload: bool) -> None:
    """Shard each block, then the root (embedding, final norm, head), over ``mesh``.

    Parameters stay fp32 (the optimizer's master copy); with bf16 the policy casts them for
    compute and reduces gradients in fp32. With ``cpu_offload`` they live in CPU memory and FSDP
    copies each block's to the GPU for its forward and backward.
    """
    kwargs = {}
    if dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    layers = model.layers
    sharded = mesh.size() > 1
    for i, block in enumerate(layers):
        # The last block's parameters are needed at once by backward: keep them gathered. With
        # one rank resharding frees nothing (each rank holds everything), so nothing reshards.
        fully_shard(block, mesh=mesh, reshard_after_forward=sharded and i < len(layers) - 1, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    if sharded:
        # Explicit prefetch: each block's all-gather is issued one block ahead, in forward and in
        # backward, so communication overlaps the block that computes now.
        for i, block in enumerate(layers):
            if i + 1 < len(layers):
                block.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([layers[i - 1]])


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP was applied (the model has FSDP's methods)."""
    return hasattr(model, "set_requires_all_reduce")


def accumulate(model: nn.Module, micro_batches: Sequence, backward: Callable[[object], None]) -> None:
    """Run ``backward`` on each micro-batch, gradients summed into the sharded ``.grad``.

    Every micro-batch's gradients are reduce-scattered as they come (FSDP's default), so a rank
    never holds more than its shard of them between micro-batches: turning the sync off
    instead (``set_requires_gradient_sync(False)``) would keep the full unsharded fp32
    gradients until the last one, ~4 bytes per parameter per GPU. Under HSDP only the
    all-reduce across replicas waits for the last micro-batch: the sum stays sharded and the
    cross-node traffic is paid once per step.
    """
    sharded = is_sharded(model)
    for i, micro in enumerate(micro_batches):
        if sharded:
            model.set_requires_all_reduce(i == len(micro_batches) - 1)
        backward(micro)
