"""Materialise a model built on ``meta`` after it was sharded: each rank allocates and fills only
its own shards, so host and device memory at start is about a rank's share, not the model."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from rayllm.model.llama import initial_weight

# Wrappers that insert a level into parameter names (torch.compile, activation checkpointing):
# the initial values are keyed by the plain model's names.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def plain_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, buffer_device: torch.device | None = None) -> None:
    """Allocate ``model``'s (sharded) parameters on ``device`` and give each its initial value.

    Each full parameter is generated one at a time on ``device`` and cut to this rank's shard
    without communication (``distribute_tensor`` with ``src_data_rank=None``): the extra memory
    is the largest single parameter, briefly. The values are those of a single process.
    ``buffer_device``: where the rotary tables go when the parameters stay on the host (offload).
    """
    model.to_empty(device=device)
    if buffer_device is not None and buffer_device != device:
        for name, buffer in list(model.named_buffers()):
            setattr(model, name, torch.empty_like(buffer, device=buffer_device))
    model.reset_buffers()
    args = model.args
    for name, param in model.named_parameters():
        full = initial_weight(plain_name(name), tuple(param.shape), args, seed, device)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
        del full
