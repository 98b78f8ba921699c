"""Forward and backward of one step's rows: micro-batches accumulated on the whole (data- and
tensor-parallel) model, or run through this rank's pipeline stages by their schedule."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rayllm.loop import fault_injection as faults
from rayllm.loop.metrics import plain
from rayllm.parallel.cp import sequence_parts
from rayllm.parallel.fsdp import accumulate
from rayllm.parallel.pipeline import Pipeline
from rayllm.parallel.tp import loss_context


def forward_backward(
    model: nn.Module,
    pipeline: Pipeline | None,
    cp: DeviceMesh | None,
    batch: torch.Tensor,
    micro_batch: int,
    step: int,
) -> torch.Tensor:
    """Gradients of the mean loss over ``batch`` (B, T + 1) token rows, in ``micro_batch`` rows at a
    time; returns that mean loss, 0-dim, on the device (every rank of a pipeline has it; under
    context parallelism, ``cp``, each rank has its part's, and their mean is the whole's)."""
    if pipeline is not None:
        return pipeline.train_step(batch[:, :-1], batch[:, 1:])
    micro = batch.split(micro_batch)
    total = torch.zeros((), device=batch.device)

    def backward(rows: torch.Tensor) -> None:
        nonlocal total
        with loss_context(model), sequence_parts(cp, [model], rows[:, :-1], rows[:, 1:]) as (tokens, targets):
            loss = model(tokens, targets) / len(micro)  # mean cross-entropy, (B, T) or (B, T / cp) each
            if faults.NAN_FROM in os.environ:  # fault injection (tests): a diverging loss
                loss = loss * faults.loss_scale(step + 1)
            loss.backward()
        total += plain(loss.detach())  # summed on the device

    accumulate(model, micro, backward)
    return total
