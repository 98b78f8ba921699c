"""Context parallelism: every sequence split over the "cp" ranks for attention (ring attention).

torch's ``context_parallel`` does the work: around a micro-batch's forward and backward it cuts
the tokens, the targets and the model's rotary tables along the sequence, each rank keeping a
head and a tail chunk (causal attention's load balance: rank 0 of 2 holds positions 0-T/4 and
3T/4-T), and routes ``scaled_dot_product_attention`` through the ring, which passes keys and
values around the CP group. Everything else in a block is per position, so the model is
untouched: a rank's loss is the mean over its tokens, and FSDP, sharding over dp_shard x cp,
averages the gradients of the equal-sized parts into the whole sequence's (rayllm.parallel.mesh).

The rotary tables are cut like the tokens because they are exactly ``data.seq_len`` long
(``max_seq_len``), so a rank's table holds the positions of its own chunks.

torch 2.13 routes only CUDA's attention kernels through the ring. On CPU ``enable_cpu_ring``
registers the CPU flash kernel with the same ring functions (torch's private ones: there is no
public hook), so a CPU run, the tests included, trains under CP as a GPU run does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel

from rayllm.errors import ConfigError

aten = torch.ops.aten


@contextlib.contextmanager
def sequence_parts(
    mesh: DeviceMesh | None, models: Sequence[nn.Module], tokens: torch.Tensor, targets: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Around one micro-batch's forward and backward (or a pipeline's whole step): this rank's part
    of ``tokens`` and ``targets``, (B, T) each, as (B, T / cp) tensors (head and tail chunks), with
    the rotary tables of ``models`` (the model, or this rank's pipeline stages) cut alike and
    attention through the ring; as they are without a CP mesh."""
    if mesh is None:
        yield tokens, targets
        return
    tokens, targets = tokens.contiguous(), targets.contiguous()  # cut in place: not views of the batch
    if tokens.device.type == "cpu":
        enable_cpu_ring()
    tables = [table for model in models for table in (model.rope_cos, model.rope_sin)]  # (T, hd / 2) each
    buffers, seq_dims = [tokens, targets, *tables], [1, 1] + [0] * len(tables)
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers={tokens, targets}):
        yield tokens, targets


_CPU_RING: list[bool] = []


def enable_cpu_ring() -> None:
    """CPU's flash attention kernels through torch's ring (once per process)."""
    if _CPU_RING:
        return
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    except ImportError as e:
        raise ConfigError(
            f"parallel.cp on CPU needs torch 2.13's context-parallel internals ({e}); run CP on GPUs, or set parallel.cp: 1"
        ) from None

    def forward(op_call, args, kwargs):
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        q, k, v = info.local_args[:3]  # (B, H, T/cp, hd), (B, KV, T/cp, hd) twice
        extra = dict(info.local_kwargs)
        causal = info.local_args[4] if len(info.local_args) > 4 else extra.pop("is_causal", False)
        mesh = args[0].device_mesh
        out, lse = ring._templated_ring_attention(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
            is_causal=causal, scale=extra.get("scale"),
        )  # fmt: skip
        placements = args[0].placements
        return tuple(DTensor.from_local(t, mesh, placements, run_check=False) for t in (out, lse))

    def backward(op_call, args, kwargs):
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        grad_out, q, k, v, out, lse, dropout_p, causal = info.local_args[:8]
        mesh = args[1].device_mesh
        grads = ring._templated_ring_attention_backward(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse,
            is_causal=causal, dropout_p=dropout_p, scale=info.local_kwargs.get("scale"),
        )  # fmt: skip
        placements = args[1].placements
        return tuple(DTensor.from_local(g, mesh, placements, run_check=False) for g in grads)

    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = backward
    _CPU_RING.append(True)
