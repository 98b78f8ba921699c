"""Tensor parallelism for the Llama blocks, Megatron's split with sequence parallelism.

Inside a block, q/k/v and w1/w3 are split by output (column-wise), o and w2 by input
(row-wise), so each block costs two all-gathers and two reduce-scatters over the TP group
and no full activation is held between them: the norms and the residual stream stay split
along the sequence (Shard(1)). The embedding is split by vocabulary, and the output head by
vocabulary too, its logits kept split for a loss that never gathers them (loss_parallel).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
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


def apply_tp(model: nn.Module, mesh: DeviceMesh, float8: bool = False) -> None:
    """Split ``model`` (a rayllm Llama, still plain, or a pipeline stage of one) over the 1-D
    ``mesh``, in place. ``float8``: the blocks' Linears are torchao's Float8Linear
    (rayllm.parallel.float8), whose inputs are cast to float8 before they are gathered along the
    sequence."""
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        plan["norm"] = SequenceParallel()
        # Logits stay split by vocabulary: (B, T, vocab/tp) per rank, for loss_parallel.
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    if plan:
        parallelize_module(model, mesh, plan)
    model.sequence_shards = mesh.size()  # the residual stream is split along the sequence
    colwise, rowwise, prepare_input = _block_styles(float8)
    for block in model.layers.values():
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                # (x, cos, sin, kv): the normed x is gathered along the sequence; the rest is plain.
                "attention": prepare_input(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "attention.wq": colwise(),
                "attention.wk": colwise(),
                "attention.wv": colwise(),
                "attention.wo": rowwise(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w3": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
            },
        )


def _block_styles(float8: bool) -> tuple[type, type, type]:
    """(column-wise, row-wise, input-preparing) styles for a block's Linears: torchao's float8 ones
    for Float8Linear (tensorwise scaling), else torch's."""
    if not float8:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def settle_embedding_output(model: nn.Module) -> None:
    """Hand the first block a plain tensor, not the embedding's pending reduce-scatter.

    The embedding's output reaches block 0 as an ``AsyncCollectiveTensor`` (RowwiseParallel's
    asynchronous redistribute). A compiled block then returns that input's gradient as a plain
    tensor to DTensor's Redistribute backward, which fails ('Tensor' object has no attribute
    '_local_tensor'; torch 2.13). Copying the (B, T/tp, dim) shard waits for the collective
    inside autograd, so the gradient still flows to the embedding; ``.wait()`` would cut it off.
    """

    def settled(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        return out.clone() if isinstance(out, AsyncCollectiveTensor) else out

    model.tok_embeddings.register_forward_hook(settled)


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``apply_tp`` split this model: its head's weight lives on a mesh with a "tp" axis
    (alone, or beside FSDP's data-parallel axes)."""
    head = getattr(model, "output", None)
    mesh = getattr(head.weight, "device_mesh", None) if head is not None else None
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """Around forward and backward: cross-entropy over vocabulary-split logits (TP only)."""
    return loss_parallel() if is_tensor_parallel(model) else contextlib.nullcontext()
