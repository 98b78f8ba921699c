"""FSDP2 applied to a plain model: one function, torch.distributed only (no Ray)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 on GPU under "auto"; fp32 on CPU, where bf16 matmuls are slow and parity is checked."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def parallelize(model: nn.Module, *, dtype: torch.dtype, activation_checkpointing: bool = False) -> nn.Module:
    """Shard each transformer block and then the root with ``fully_shard``.

    Parameters stay fp32 (the optimizer's master copy); with bf16 the policy casts them
    for compute and reduces gradients in fp32.
    """
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    kwargs = {"mp_policy": policy} if policy else {}
    layers = model.layers
    for i, block in enumerate(layers):
        if activation_checkpointing:
            block = checkpoint_wrapper(block)
            layers[i] = block
        # The last block's parameters are needed at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model
