"""One function applies every kind of parallelism to the plain model, in torchtitan's order:
TP, activation checkpointing, compile, FSDP/HSDP, then (from ``meta``) materialise the shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rayllm.errors import ConfigError
from rayllm.parallel.checkpointing import checkpointed
from rayllm.parallel.float8 import check_float8, convert_blocks
from rayllm.parallel.fsdp import apply_fsdp
from rayllm.parallel.init import materialize
from rayllm.parallel.layout import Layout, check_model_split, checkpoint_mode, compiles
from rayllm.parallel.mesh import build_mesh, dp_mesh, tp_mesh
from rayllm.parallel.tp import apply_tp, settle_embedding_output


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 on GPU under "auto"; fp32 on CPU, where bf16 matmuls are slow and parity is checked."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def should_compile(setting: bool | str, device: torch.device) -> bool:
    """``train.compile`` on this device (rayllm.parallel.layout.compiles)."""
    return compiles(setting, device.type == "cuda")


def needs_fsdp(layout: Layout, dtype: torch.dtype, cpu_offload: bool) -> bool:
    """Whether ``fully_shard`` earns its keep: with one data-parallel rank in fp32 there is nothing to
    shard or cast, and FSDP would only add a copy of every weight and gradient to each step (about
    7% of the tiny config's step on CPU). bf16 keeps it for its mixed-precision policy, offload
    for its offload policy, context parallelism for its gradient average over the CP ranks."""
    return layout.dp * layout.cp > 1 or dtype != torch.float32 or cpu_offload


def parallelize(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    layout: Layout | None = None,
    activation_checkpointing: bool | str = False,
    cpu_offload: bool = False,
    compile: bool = False,
    float8: bool = False,
    device: torch.device | None = None,
    seed: int = 0,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """``model`` (a rayllm Llama) laid out over ``layout``'s ranks, ready to train on ``device``.

    A model built on ``meta`` is materialised here, after sharding, each rank filling only its
    shards with the values a single process would start from (``seed``): no rank ever holds the
    whole model. A model with real weights keeps them (TP and FSDP split what is there).
    ``float8``: the blocks' matmuls in float8 (rayllm.parallel.float8), emulated off a GPU.
    ``mesh``: the layout's, when several pipeline stages share it (rayllm.parallel.pipeline); built
    here otherwise.
    """
    layout = layout or Layout()
    device = device or torch.device("cpu")
    if cpu_offload and device.type != "cuda":
        raise ConfigError(
            "train.cpu_offload needs a GPU: FSDP offloads GPU state to CPU memory. Set cluster.use_gpu: true, "
            "or train.cpu_offload: false on CPU (the model already lives in CPU memory)"
        )
    args = model.args
    check_model_split(
        layout,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        hidden=args.hidden_dim,
        seq_len=args.max_seq_len,
        tied=args.tie_embeddings,
    )
    on_meta = model.rope_cos.is_meta
    fsdp = needs_fsdp(layout, dtype, cpu_offload)
    if mesh is None and (fsdp or layout.tp > 1 or layout.cp > 1):
        mesh = build_mesh(layout, device.type)
    if float8:
        check_float8(device)
        convert_blocks(model, all_gather_float8=fsdp and layout.dp_shard > 1, emulate=device.type != "cuda")
    if layout.tp > 1:
        apply_tp(model, tp_mesh(mesh), float8=float8)
    wrap_blocks(model, activation_checkpointing=activation_checkpointing, compile=compile, tp=layout.tp)
    if fsdp:
        apply_fsdp(model, dp_mesh(mesh, layout), dtype=dtype, cpu_offload=cpu_offload, pipelined=layout.pp > 1)
    if on_meta:
        # With offload FSDP keeps the shards in CPU memory and copies them to the GPU per block.
        materialize(model, torch.device("cpu") if cpu_offload else device, seed, buffer_device=device)
    elif not fsdp:
        model.to(device)
    return model


def wrap_blocks(model: nn.Module, *, activation_checkpointing: bool | str, compile: bool, tp: int = 1) -> None:
    """Each block checkpointed (rayllm.parallel.checkpointing) and/or compiled, in place, before
    FSDP wraps it; under compile the loss too."""
    mode = checkpoint_mode(activation_checkpointing)
    layers = model.layers
    for key, block in list(layers.items()):
        if mode == "full" and compile and tp > 1:
            # Compiling a fully checkpointed TP block fails (torch 2.13: AOTAutograd saves the
            # DTensor's DeviceMesh among the tensors; selective checkpointing compiles), so the
            # compiled block is checkpointed instead: compiled in place (its parameter names keep no
            # "_orig_mod"), FSDP's hooks on the wrapper.
            block.compile(fullgraph=True)
            block = checkpointed(block, mode)
        else:
            if mode != "off":
                block = checkpointed(block, mode)
            if compile:
                # Per block, as torchtitan does: every block has the same code, so one compiled
                # graph serves all of them, and FSDP's hooks stay outside the compiled region.
                block = torch.compile(block, fullgraph=True)
        layers[key] = block
    if compile and tp > 1 and model.tok_embeddings is not None:
        settle_embedding_output(model)
    if compile and tp == 1:
        # The loss alone (the norm and head modules carry FSDP hooks, see Llama.forward): the
        # fp32 upcast fuses into the log-softmax over the (B, T, vocab) logits. (Under TP the
        # logits are split by vocabulary and the loss is loss_parallel's.)
        model.loss_fn = torch.compile(model.loss_fn, fullgraph=True)
