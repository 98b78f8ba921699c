"""``rayllm plan``: the memory one GPU needs for a training step, from the config alone.

Arithmetic only (no torch, no torch.distributed), the torchtitan/Megatron way: every term is
bytes per GPU at the step's peak, which comes in backward of a micro-batch after the first,
when the sharded gradients, the optimizer state and all saved activations coexist. The
activation terms count the tensors autograd saves in rayllm's own Llama (eager): on CPU they
match the live bytes of PyTorch's profiler to 0.01% (tests/integration/test_plan_measured.py). On GPU torch.compile fuses the
norms and saves somewhat less, so the plan errs high.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache

from rayllm.errors import ConfigError
from rayllm.parallel.gpus import GPUS, GpuSpec
from rayllm.parallel.layout import (
    Layout,
    check_model_split,
    checkpoint_mode,
    compiles,
    resolve_layout,
)
from rayllm.parallel.planner_pp import PipelineTerms, pipeline_terms
from rayllm.parallel.pp import plan_pipeline
from rayllm.parallel.shape_counts import (
    Shape,
    block_bytes_per_token,
    flops_per_token,
    loss_bytes_per_token,
    model_shape,
    selective_block_bytes_per_token,
)

GIB = 2**30
# CUDA context and kernel images of torch and NCCL, cuBLAS workspaces: ~2 GiB a process, fixed.
GPU_FRAMEWORK_BYTES = 2 * GIB
# The caching allocator's fragmentation: 5% of what the step allocates (torchtitan and Megatron
# runs leave this much between "reserved" and "allocated").
GPU_ALLOCATOR_SLACK = 0.05
# On CPU the step runs on glibc's heap, which the Trainer keeps from shrinking (keep_freed_memory):
# the next micro-batch's tensors only partly fit the holes the last one's left, so the resident
# peak exceeds the live bytes by 25-36% of the transient bytes (activations, logits) on 8-layer
# models 512 and 768 wide (docs/parallelism.md).
CPU_HEAP_SLACK = 0.35
# NCCL's own buffers for each communicator a rank uses (channels x peers x NCCL_BUFFSIZE).
NCCL_BYTES_PER_GROUP = 256 * 2**20
ASSUMED_MFU = 0.4  # for the step-time estimate only, compiled
# An eager step's speed against a compiled one's (train.compile: false): compile fuses the norms,
# SiLU and the loss's passes; an estimate, as ASSUMED_MFU is.
EAGER_SPEED = 0.85
# recommend() keeps 10% of the GPU free for what the plan does not count (compile's and attention's
# workspaces, NCCL growing its buffers, a spike of the optimizer step).
RECOMMEND_HEADROOM = 0.9
# Of FSDP's traffic, the share no prefetch hides (see MemoryPlan.step_seconds).
EXPOSED_FSDP_SHARE = 0.1
# Compute with each checkpointing mode against none: full runs every block's forward again (a third
# more: forward is a third of forward + backward); selective only its element-wise ops, which are
# memory-bound, a few percent of a step (an estimate, as ASSUMED_MFU is).
RECOMPUTE_FACTOR = {"off": 1.0, "full": 4 / 3, "selective": 1.03}
# TP's all-gathers and reduce-scatters of (tokens, dim) per block and step: 4 forward, 4 backward;
# full checkpointing repeats the forward's 4, selective only its 2 all-gathers (it keeps the
# reduce-scatters' outputs).
TP_COLLECTIVES_PER_BLOCK = {"off": 8, "full": 12, "selective": 10}
FULL_MATMUL_TOKENS = 8192


@dataclass
class MemoryPlan:
    layout: Layout
    micro_batch: int
    breakdown: dict[str, int]  # bytes per GPU by term (the keys below)
    activations_by_mode: dict[str, int]  # one micro-batch's, for each train.activation_checkpointing mode
    total_bytes: int
    fits: bool | None  # None when no GPU was given (CPU accounting)
    comm_bytes_per_step: dict[str, int] = field(default_factory=dict)
    activation_checkpointing: str = "off"  # rayllm.parallel.layout.CHECKPOINT_MODES
    gpu: GpuSpec | None = None
    parts: dict[str, int] = field(default_factory=dict)  # the sub-terms the table shows
    accum: int = 1
    params: int = 0
    dtype: str = "fp32"
    seconds: dict[str, float] = field(default_factory=dict)  # estimated compute and communication per step
    pipeline: PipelineTerms | None = None  # under parallel.pp: the busiest rank's

    @property
    def step_seconds(self) -> float | None:
        """The step's estimated time: compute (recompute included) plus the communication it does
        not hide. TP's collectives and HSDP's all-reduce sit on the critical path; FSDP's prefetched
        all-gathers and reduce-scatters hide behind compute, but for EXPOSED_FSDP_SHARE of them
        (each micro-batch's first all-gather and last reduce-scatter, and the links' contention
        with the kernels), and all of what the compute is too short to cover."""
        t = self.seconds
        if not t:
            return None
        hideable = (1 - EXPOSED_FSDP_SHARE) * t["fsdp"]
        exposed = (
            EXPOSED_FSDP_SHARE * t["fsdp"] + max(0.0, hideable - t["compute"]) + t["tp"] + t["hsdp"] + t["pp"] + t["cp"]
        )
        return t["compute"] + exposed

    def summary(self) -> str:
        ac = self.activation_checkpointing
        where = f" of {_gib(self.gpu.memory_bytes)}" if self.gpu else ""
        fits = "" if self.fits is None else (": fits" if self.fits else ": does NOT fit")
        lay = self.layout
        pp, pipe = f"pp {lay.pp} x " if lay.pp > 1 else "", self.pipeline
        cp = f"cp {lay.cp} x " if lay.cp > 1 else ""
        stages = ""
        if pipe is not None:
            busiest = (
                f"pipeline rank {pipe.rank.rank}: {pipe.rank.layers} blocks, {pipe.rank.in_flight:g} micro-batches held"
            )
            stages = f" of {pipe.schedule}, bubble {pipe.bubble:.0%}, {busiest}"
        return (
            f"{lay.describe()} ({pp}dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x {cp}tp {lay.tp}), "
            f"micro-batch {self.micro_batch} ({self.accum} {'micro-batches' if pp else 'accumulation steps'}{stages}), "
            f"activation checkpointing {ac}: {_gib(self.total_bytes)}{where} per {'GPU' if self.gpu else 'rank'}{fits}"
        )

    def comm_line(self) -> str:
        c, t = self.comm_bytes_per_step, self.seconds
        line = (
            f"communication per {'GPU' if self.gpu else 'rank'} per step: FSDP all-gather {c['fsdp_all_gather'] / 1e9:,.1f} GB, reduce-scatter "
            f"{c['fsdp_reduce_scatter'] / 1e9:,.1f} GB, HSDP all-reduce {c['hsdp_all_reduce'] / 1e9:,.1f} GB, "
            f"TP collectives {c['tp_collectives'] / 1e9:,.1f} GB"
        )
        line += f", pipeline sends {c['pp_send'] / 1e9:,.1f} GB" if self.pipeline else ""
        line += f", CP ring {c['cp_ring'] / 1e9:,.1f} GB" if self.layout.cp > 1 else ""
        if t:
            pp = f", PP {t['pp']:.2f} s" if self.pipeline else ""
            pp += f", CP {t['cp']:.2f} s" if self.layout.cp > 1 else ""
            line += (
                f"\n  at link speed: FSDP {t['fsdp']:.2f} s, HSDP {t['hsdp']:.2f} s, TP {t['tp']:.2f} s{pp}; "
                f"compute {t['compute']:.2f} s at {t['mfu']:.0%} MFU{'' if t['mfu'] == ASSUMED_MFU else ' (eager)'}; "
                f"step about {self.step_seconds:.2f} s"
            )
        return line

    def format(self) -> str:
        p, staged = self.parts, self.pipeline is not None
        gathered = "its stages, all step" if staged else "2 blocks + head"
        unsharded = "its stages' fp32 until the step's end" if staged else "block and head"
        notes = {
            "parameters": f"fp32 shard {p['param_shard']:,} + {self.dtype} gathered ({gathered}) {p['gathered']:,}",
            "gradients": f"fp32 shard {p['grad_shard']:,} + unsharded ({unsharded}) {p['grad_unsharded']:,}",
            "optimizer": "AdamW exp_avg + exp_avg_sq, fp32, sharded",
            "activations": "checkpointing "
            + ", ".join(f"{mode} {_gib(b)}" for mode, b in self.activations_by_mode.items()),
            "logits_loss": "logits/tp: fp32 log-softmax, its gradient and the input's; final norm",
            "comm_buffers": "NCCL buffers per process group, FSDP copy-in/out"
            + (", a receive buffer per micro-batch" if staged else ""),
            "framework_reserve": "CUDA context, kernels, cuBLAS" if self.gpu else "measured: process with torch",
            "allocator_slack": "5% caching-allocator fragmentation" if self.gpu else "35% of transients: heap holes",
        }
        lines = [f"rayllm plan: {self.params:,} parameters, {self.dtype} compute", "  " + self.summary()]
        lines.append(f"  {'term':<18} {'GiB':>8} {'bytes':>17}  what")
        for name, value in self.breakdown.items():
            lines.append(f"  {name:<18} {value / GIB:8.2f} {value:>17,}  {notes.get(name, '')}")
        lines.append(f"  {'total':<18} {self.total_bytes / GIB:8.2f} {self.total_bytes:>17,}")
        lines.append("  " + self.comm_line())
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def gpu_spec(gpu: str | GpuSpec | None) -> GpuSpec | None:
    if gpu is None or isinstance(gpu, GpuSpec):
        return gpu
    if gpu not in GPUS:
        raise ConfigError(f"unknown GPU {gpu!r}; choose one of: {', '.join(GPUS)}")
    return GPUS[gpu]


@cache
def measured_framework_bytes() -> int:
    """A fresh process's resident memory once torch is imported: a CPU rank's baseline before the model."""
    code = "import torch, rayllm.hardware as h; print(h.resident_bytes())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def plan_memory(
    config,
    *,
    gpu: str | GpuSpec | None,
    nodes: int = 1,
    gpus_per_node: int = 1,
    layout: Layout | None = None,
    micro_batch: int | None = None,
    activation_checkpointing: bool | str | None = None,
    framework_bytes: int | None = None,
) -> MemoryPlan:
    """Bytes per GPU (per CPU rank when ``gpu`` is None) of ``config``'s step on nodes x gpus_per_node."""
    spec = gpu_spec(gpu)
    s, t = model_shape(config.model), config.train
    world = nodes * gpus_per_node
    if layout is None:
        layout = resolve_layout(
            config.parallel, world, ranks_per_node=gpus_per_node, n_params=s.total, use_gpu=spec is not None
        )
    check_split(layout, config)
    micro = micro_batch or t.micro_batch_size
    ac = checkpoint_mode(t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing)
    e = 2 if t.precision == "bf16" or (t.precision == "auto" and spec is not None) else 4
    tokens = micro * config.data.seq_len // layout.cp  # a rank's part of each micro-batch (CP splits sequences)
    accum = max(1, math.ceil(t.global_batch_size / (micro * layout.dp)))
    pipe = None
    if layout.pp > 1:  # the busiest pipeline rank's share (rayllm.parallel.planner_pp)
        plan_pipeline(config.parallel, accum, s.layers, compiles(t.compile, spec is not None))  # or its refusal
        pipe = pipeline_terms(config, s, layout, e=e, tokens=tokens, microbatches=accum, offload=t.cpu_offload, ac=ac)
        parts, by_mode, logits_loss = pipe.parts, pipe.activations_by_mode, pipe.logits_loss
    else:
        parts = _state_bytes(s, layout, e, t.cpu_offload)
        by_mode, logits_loss = _activation_bytes(s, e, layout.tp, tokens)
    activations = by_mode[ac]
    # NCCL's buffers per communicator in use; FSDP's all-gather inputs and reduce-scatter outputs;
    # a pipeline stage's receive buffers.
    groups = sum(1 for n in (layout.dp_shard, layout.dp_replicate, layout.tp, layout.pp, layout.cp) if n > 1)
    shards = layout.dp_shard * layout.cp * layout.tp
    comm = groups * NCCL_BYTES_PER_GROUP + int(2 * s.block / shards * (2 * e + 4)) if spec and world > 1 else 0
    comm += pipe.buffers if pipe else 0
    breakdown = {
        "parameters": parts["param_shard"] + parts["gathered"],
        "gradients": parts["grad_shard"] + parts["grad_unsharded"],
        "optimizer": 2 * parts["param_shard"],  # AdamW (fused): exp_avg and exp_avg_sq in fp32, sharded alike
        "activations": activations,
        "logits_loss": logits_loss,
        "comm_buffers": comm,
    }
    breakdown.update(_reserve(breakdown, spec, activations + logits_loss, framework_bytes))
    total = sum(breakdown.values())
    comm_bytes = _communication(s, layout, accum, tokens, e, ac, pipe)
    seconds = _seconds(s, layout, spec, comm_bytes, config, ac, gpus_per_node, pipe) if spec else {}
    return MemoryPlan(
        layout=layout,
        micro_batch=micro,
        breakdown=breakdown,
        activations_by_mode=by_mode,
        total_bytes=total,
        fits=None if spec is None else total <= spec.memory_bytes,
        comm_bytes_per_step=comm_bytes,
        activation_checkpointing=ac,
        gpu=spec,
        parts=parts,
        accum=accum,
        params=s.total,
        dtype="bf16" if e == 2 else "fp32",
        seconds=seconds,
        pipeline=pipe,
    )


def _state_bytes(s: Shape, layout: Layout, e: int, cpu_offload: bool) -> dict[str, int]:
    """Parameters' and gradients' bytes per rank: param_shard, gathered, grad_shard, grad_unsharded."""
    tp, shard, dp = layout.tp, layout.dp_shard * layout.cp, layout.dp  # FSDP shards over dp_shard x cp
    fsdp = dp * layout.cp > 1 or e != 4 or cpu_offload  # as rayllm.parallel.apply.needs_fsdp
    on_gpu_state = 0 if cpu_offload else 1  # offload keeps the sharded state in CPU memory
    # Parameters: the fp32 master copy, sharded over dp_shard x tp (HSDP replicates it across
    # dp_replicate). FSDP all-gathers each unit in compute dtype for its forward and backward, the
    # next one prefetched: 2 blocks in flight, and the head (with tied embeddings the whole root)
    # from its forward to its backward. On one rank nothing reshards: the whole model stays gathered.
    param_shard = 4 * math.ceil(s.total / (shard * tp)) * on_gpu_state
    gathered_params = (min(2, s.layers) * s.block + s.held_root if dp > 1 else s.total) / tp
    gathered = int(gathered_params * e) if fsdp else 0
    # Gradients: fp32, sharded like the parameters (every micro-batch is reduce-scattered, so they
    # stay sharded across accumulation), plus one block's unsharded gradient in compute dtype and
    # its fp32 reduce-scatter input; untied, the head's too (its reduce-scatter may still run while
    # the last block's backward does); tied, the root's, reduced only when backward ends.
    grad_shard = param_shard
    head = s.root * e if s.tied else s.held_root * (e + 4)
    grad_unsharded = int((s.block * (e + 4) + head) / tp) if fsdp else 0
    return dict(param_shard=param_shard, gathered=gathered, grad_shard=grad_shard, grad_unsharded=grad_unsharded)


def _activation_bytes(s: Shape, e: int, tp: int, tokens: int) -> tuple[dict[str, int], int]:
    """({checkpointing mode: activations}, logits and loss) of one micro-batch per rank."""
    # Activations of one micro-batch; with full checkpointing each block keeps only its input (on the
    # sequence shard under TP), selective keeps what it does not recompute, and in both one block at
    # a time is recomputed during backward (full: a whole block's; selective: at most that).
    per_block = block_bytes_per_token(s, e, tp) * tokens
    by_mode = {
        "off": int(s.layers * per_block),
        "full": int(s.layers * e * s.d * tokens / tp + per_block),
        "selective": int(s.layers * selective_block_bytes_per_token(s, e, tp) * tokens + per_block),
    }
    logits_loss = int(tokens * loss_bytes_per_token(s, e, tp))  # logits (micro, seq, vocab / tp) and the loss
    return by_mode, logits_loss


def _reserve(breakdown: dict[str, int], spec: GpuSpec | None, transient: int, framework_bytes: int | None):
    """The framework's fixed bytes and the allocator's slack over what the step allocates
    (``transient``: activations and logits, what the CPU heap's slack grows with)."""
    if spec is not None:
        return {
            "framework_reserve": GPU_FRAMEWORK_BYTES,
            "allocator_slack": int(GPU_ALLOCATOR_SLACK * (sum(breakdown.values()) + GPU_FRAMEWORK_BYTES)),
        }
    framework = measured_framework_bytes() if framework_bytes is None else framework_bytes
    return {"framework_reserve": framework, "allocator_slack": int(CPU_HEAP_SLACK * transient)}


def _communication(
    s: Shape, layout: Layout, accum: int, tokens: int, e: int, ac: str, pipe: PipelineTerms | None = None
) -> dict[str, int]:
    """Bytes each GPU sends per optimizer step (a ring moves (n-1)/n of the data per rank)."""
    tp, shard, rep = layout.tp, layout.dp_shard * layout.cp, layout.dp_replicate
    ring = (shard - 1) / shard
    if pipe is not None:
        return _pipeline_communication(s, layout, accum, tokens, e, ac, pipe)
    # Forward gathers every parameter; backward gathers the blocks again, but the last, and untied
    # the embedding again (it reshards after its forward; the head stays gathered).
    again = (s.layers - 1) * s.block + (0 if s.tied else s.root - s.held_root)
    gathered = (s.total + again) / tp * e
    reduce = s.total / tp * 4  # fp32 reduce dtype, every micro-batch
    all_reduce = 2 * (rep - 1) / rep * s.total / (tp * shard) * 4 if rep > 1 else 0  # once a step (HSDP)
    # Sequence parallelism: per block 2 all-gathers + 2 reduce-scatters of (tokens, dim) forward, as many
    # backward, 4 more to recompute under checkpointing; 4 for the embedding and the head.
    tp_volume = (TP_COLLECTIVES_PER_BLOCK[ac] * s.layers + 4) * tokens * s.d * e * (tp - 1) / tp
    return {
        "fsdp_all_gather": int(accum * gathered * ring),
        "fsdp_reduce_scatter": int(accum * reduce * ring),
        "hsdp_all_reduce": int(all_reduce),
        "tp_collectives": int(accum * tp_volume),
        "pp_send": 0,
        "cp_ring": _cp_ring_bytes(s.layers, s, layout, accum, tokens, e, ac),
    }


def _cp_ring_bytes(layers: int, s: Shape, layout: Layout, accum: int, tokens: int, e: int, ac: str) -> int:
    """Context parallelism's ring: each rank's keys and values (``tokens`` of its part, KV heads split
    by TP) go to the cp - 1 others in the attention forward of every block it holds (``layers``),
    again with their gradients in backward, and once more when full checkpointing recomputes the
    forward."""
    passes = 3 + (ac == "full")
    return int(accum * layers * (layout.cp - 1) * tokens * 2 * s.kv / layout.tp * e * passes)


def _pipeline_communication(
    s: Shape, layout: Layout, accum: int, tokens: int, e: int, ac: str, pipe: PipelineTerms
) -> dict[str, int]:
    """As _communication, for the busiest pipeline rank (which sets the step): its stages gathered
    once a step (they stay gathered) and reduce-scattered once (after the last micro-batch), its
    blocks' TP collectives, and the stages' sends."""
    tp, shard, rep, r = layout.tp, layout.dp_shard * layout.cp, layout.dp_replicate, pipe.busiest
    ring = (shard - 1) / shard
    ends = 4 * (r.first + r.last)  # the embedding's and the head's TP collectives
    tp_volume = (TP_COLLECTIVES_PER_BLOCK[ac] * r.layers + ends) * tokens * s.d * e * (tp - 1) / tp
    return {
        "fsdp_all_gather": int(r.params / tp * e * ring),
        "fsdp_reduce_scatter": int(r.params / tp * 4 * ring),
        "hsdp_all_reduce": int(2 * (rep - 1) / rep * r.params / (tp * shard) * 4) if rep > 1 else 0,
        "tp_collectives": int(accum * tp_volume),
        "pp_send": pipe.p2p_bytes,
        "cp_ring": _cp_ring_bytes(r.layers, s, layout, accum, tokens, e, ac),
    }


def _seconds(
    s: Shape, layout: Layout, g: GpuSpec, c: dict[str, int], config, ac: str, per_node: int, pipe: PipelineTerms | None
) -> dict:
    """Rough step time: compute at ASSUMED_MFU (a third more with recompute); each collective at its
    link's speed. A pipeline's step is its busiest rank's compute stretched by the schedule's
    bubble; its sends cross nodes (the stages are the outermost axis)."""
    tokens = config.train.global_batch_size * config.data.seq_len / (layout.dp * layout.cp)
    mfu = ASSUMED_MFU * (1.0 if compiles(config.train.compile, True) else EAGER_SPEED)
    compute = flops_per_token(s, config.data.seq_len) * tokens / layout.tp / (g.bf16_dense_flops * mfu)
    if pipe is not None:
        compute *= pipe.busiest.flops_share / (1 - pipe.bubble)
    fsdp_link = (
        g.intra_node_bytes_per_s if layout.dp_shard * layout.cp * layout.tp <= per_node else g.inter_node_bytes_per_s
    )
    cp_link = g.intra_node_bytes_per_s if layout.cp * layout.tp <= per_node else g.inter_node_bytes_per_s
    return {
        "cp": c["cp_ring"] / cp_link,
        "pp": c["pp_send"] / g.inter_node_bytes_per_s,
        "compute": compute * RECOMPUTE_FACTOR[ac],
        "mfu": mfu,
        "fsdp": (c["fsdp_all_gather"] + c["fsdp_reduce_scatter"]) / fsdp_link,
        "hsdp": c["hsdp_all_reduce"] / g.inter_node_bytes_per_s,
        "tp": c["tp_collectives"] / g.intra_node_bytes_per_s,
    }


def check_split(layout: Layout, config) -> None:
    m = config.model
    hidden = model_shape(m).hidden
    check_model_split(
        layout, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, hidden=hidden, seq_len=config.data.seq_len,
        tied=m.tie_embeddings,
    )  # fmt: skip
