"""FSDP2 applied to a plain model: one function, torch.distributed only (no Ray)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from rayllm.errors import ConfigError


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 on GPU under "auto"; fp32 on CPU, where bf16 matmuls are slow and parity is checked."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def should_compile(setting: bool | str, device: torch.device) -> bool:
    """``train.compile``: "auto" compiles on GPU only (on CPU it needs a C++ compiler and long runs)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def needs_sharding(world_size: int, dtype: torch.dtype, cpu_offload: bool) -> bool:
    """Whether ``fully_shard`` earns its keep: with one rank in fp32 there is nothing to shard or
    cast, and FSDP would only add a copy of every weight and gradient to each step (about 7% of
    the tiny config's step on CPU). bf16 keeps it for its mixed-precision policy, offload for
    its offload policy."""
    return world_size > 1 or dtype != torch.float32 or cpu_offload


def parallelize(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    world_size: int,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    compile: bool = False,
    device: torch.device | None = None,
) -> nn.Module:
    """Wrap each transformer block (activation checkpointing, then ``torch.compile``), then shard
    each block and the root with ``fully_shard`` (see ``needs_sharding``).

    Parameters stay fp32 (the optimizer's master copy); with bf16 the policy casts them for
    compute and reduces gradients in fp32. With ``cpu_offload`` they live in CPU memory and FSDP
    copies each block's to the GPU for its forward and backward.
    """
    if cpu_offload and (device is None or device.type != "cuda"):
        raise ConfigError(
            "train.cpu_offload needs a GPU: FSDP offloads GPU state to CPU memory. Set cluster.use_gpu: true, "
            "or train.cpu_offload: false on CPU (the model already lives in CPU memory)"
        )
    layers = model.layers
    for i, block in enumerate(layers):
        if activation_checkpointing:
            block = checkpoint_wrapper(block)
        if compile:
            # Per block, as torchtitan does: every block has the same code, so one compiled
            # graph serves all of them, and FSDP's hooks stay outside the compiled region.
            block = torch.compile(block, fullgraph=True)
        layers[i] = block
    if compile:
        # The head too: fusing the final norm and the log-softmax over the logits saves ~10% of
        # the tiny model's step on CPU. Compiled as a method of the root, it runs inside the
        # root's forward, where FSDP has gathered the root's parameters.
        model.head_loss = torch.compile(model.head_loss, fullgraph=True)
    if not needs_sharding(world_size, dtype, cpu_offload):
        return model.to(device) if device is not None else model
    kwargs = {}
    if dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for i, block in enumerate(layers):
        # The last block's parameters are needed at once by backward: keep them gathered. With
        # one rank resharding frees nothing (each rank holds everything), so nothing reshards.
        reshard = world_size > 1 and i < len(layers) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, **kwargs)
    if world_size > 1:
        # Explicit prefetch: each block's all-gather is issued one block ahead, in forward and in
        # backward, so communication overlaps the block that computes now.
        for i, block in enumerate(layers):
            if i + 1 < len(layers):
                block.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([layers[i - 1]])
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``parallelize`` applied FSDP (the model has FSDP's methods)."""
    return hasattr(model, "set_requires_gradient_sync")
