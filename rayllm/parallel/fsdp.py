"""FSDP2 over the data-parallel mesh (1-D: FSDP; 2-D replicate x shard: HSDP), and the
gradient-sync rule for accumulation that keeps gradients sharded."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, dtype: torch.dtype, cpu_offload: bool, pipelined: bool = False
) -> None:
    """Shard the embedding, each block, the final norm with the head, then the root, over ``mesh``.

    Parameters stay fp32 (the optimizer's master copy); with bf16 the policy casts them for
    compute and reduces gradients in fp32. Only the root casts its inputs (token ids: nothing to
    cast): a block's hidden state is bf16 already, and its RoPE tables must reach it in fp32.
    With ``cpu_offload`` parameters live in CPU memory and FSDP copies each unit's to the GPU for
    its forward and backward. ``pipelined``: ``model`` is a pipeline stage, whose units stay
    gathered from their first forward to the step's end: a schedule runs several micro-batches'
    forwards before their backwards, which would otherwise gather every unit once per micro-batch,
    and zero-bubble schedules give wrong gradients with resharding units (torch 2.13, found on CPU).
    """
    root, unit = {}, {}
    if dtype != torch.float32:
        root["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        unit["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    if cpu_offload:
        root["offload_policy"] = unit["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    sharded = mesh.size() > 1
    units = forward_units(model)
    # Backward needs the last units' parameters at once (the head's unless tied, the last block's):
    # they stay gathered. With one rank resharding frees nothing (each rank holds everything).
    held_from = 0 if pipelined else len(units) - (1 if model.args.tie_embeddings else 2)
    for i, modules in enumerate(units):
        fully_shard(modules, mesh=mesh, reshard_after_forward=sharded and i < held_from, **unit)
    fully_shard(model, mesh=mesh, reshard_after_forward=not pipelined, **root)
    if sharded:
        # Explicit prefetch: each unit's all-gather is issued one unit ahead, in forward and in
        # backward, so communication overlaps the unit that computes now.
        first = [m[0] if isinstance(m, list) else m for m in units]
        for before, after in zip(first, first[1:], strict=False):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])


def forward_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """FSDP's units below the root, in forward order: the embedding, each block, the final norm
    with the head. Each is gathered only while it computes, so the root holds nothing that stays
    gathered through the whole step (torchtitan's units). Tied embeddings share one weight
    between the first and the last unit: it stays in the root, gathered throughout."""
    layers = list(model.layers.values())
    if model.args.tie_embeddings:
        return layers
    first = [model.tok_embeddings] if model.tok_embeddings is not None else []  # a pipeline stage may lack
    last = [[model.norm, model.output]] if model.output is not None else []  # either end
    return [*first, *layers, *last]


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
