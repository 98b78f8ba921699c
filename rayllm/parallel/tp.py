"""Tensor parallelism for the Llama blocks, Megatron's split with sequence parallelism.

Inside a block, q/k/v and w1/w3 are split by output (column-wise), o and w2 by input
(row-wise), so each block costs two all-gathers and two reduce-scatters over the TP group
and no full activation is held between them: the norms and the residual stream stay split
along the sequence (Shard(1)). The embedding is split by vocabulary, and the output head by
vocabulary too, its logits kept split for a loss that never gathers them (loss_parallel).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``model`` (a rayllm Llama, still plain) over the 1-D ``mesh``, in place."""
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # Logits stay split by vocabulary: (B, T, vocab/tp) per rank, for loss_parallel.
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                # (x, cos, sin, kv): the normed x is gathered along the sequence; the rest is plain.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``apply_tp`` split this model: its head's weight lives on a mesh with a "tp" axis
    (alone, or beside FSDP's data-parallel axes)."""
    mesh = getattr(model.output.weight, "device_mesh", None)
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """Around forward and backward: cross-entropy over vocabulary-split logits (TP only)."""
    return loss_parallel() if is_tensor_parallel(model) else contextlib.nullcontext()
