"""The memory planner's pipeline terms: what the busiest pipeline rank holds and sends.

Under ``parallel.pp`` a rank holds only its stages' parameters (rayllm.parallel.pp.split_stages),
but the schedule keeps several micro-batches' activations in flight, FSDP keeps the stages'
units gathered for the whole step (rayllm.parallel.fsdp, ``pipelined``), and torch's stage
accumulates its unsharded fp32 gradients until the step's last backward before one
reduce-scatter. Each rank is counted and the heaviest is the plan: the first ranks hold the
most activations under 1F1B, the last holds the head and the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayllm.parallel.layout import Layout
from rayllm.parallel.pp import StagePart, part_costs, schedule_costs, split_stages
from rayllm.parallel.shape_counts import (
    Shape,
    block_bytes_per_token,
    held_loss_bytes_per_token,
    loss_bytes_per_token,
    selective_block_bytes_per_token,
)

# The schedules the planner costs as one it knows: LoopedBFS runs every micro-batch's forward of
# a stage before the next stage's (GPipe's peak); the zero-bubble one holds at least Interleaved1F1B's
# activations (its weight gradients wait, so a little more) and has no more bubble.
COSTED_AS = {"LoopedBFS": "GPipe", "InterleavedZeroBubble": "Interleaved1F1B"}


@dataclass(frozen=True)
class PipelineRank:
    """One pipeline rank's share, per GPU (its dp_shard x tp group shards it further)."""

    rank: int
    params: int  # of its stages
    layers: int  # blocks it holds
    first: bool
    last: bool
    in_flight: float  # micro-batches of activations held at its peak, through all of its layers
    flops_share: float  # of the whole model's training FLOPs per token


@dataclass(frozen=True)
class PipelineTerms:
    """The heaviest rank's bytes, and the pipeline's step-time terms."""

    schedule: str
    stages_per_rank: int
    rank: PipelineRank  # the heaviest in memory: the plan's bytes are its
    busiest: PipelineRank  # the most compute (blocks, the head): the step's time and traffic are its
    parts: dict[str, int]  # param_shard, gathered, grad_shard, grad_unsharded, as planner._state_bytes
    activations_by_mode: dict[str, int]
    logits_loss: int
    buffers: int  # the stage's receive buffers: every micro-batch's input and its gradient
    bubble: float
    p2p_bytes: int  # sent per step by one rank: activations forward, their gradients backward
    rank_bytes: tuple[int, ...]  # every pipeline rank's counted bytes (state, activations, logits, buffers)


def pipeline_ranks(
    config, layout: Layout, stages_per_rank: int, microbatches: int, schedule: str
) -> list[PipelineRank]:
    """Every pipeline rank's parameters, layers and in-flight micro-batches."""
    m, pp, v, seq = config.model, layout.pp, stages_per_rank, config.data.seq_len
    parts = split_stages(m, pp * v, seq)
    costs = schedule_costs(COSTED_AS.get(schedule, schedule), pp, microbatches, v)
    weights = part_costs(m, seq)
    whole = m.n_layers * weights.block + weights.head + weights.embedding
    block = _block_params(m)
    ranks = []
    for r in range(pp):
        mine: list[StagePart] = parts[r::pp]
        layers = sum(len(p.layers) for p in mine)
        first, last = any(p.first for p in mine), any(p.last for p in mine)
        params = layers * block + (m.vocab_size * m.dim if first else 0) + ((m.vocab_size + 1) * m.dim if last else 0)
        flops = layers * weights.block + (weights.head if last else 0)
        ranks.append(PipelineRank(r, params, layers, first, last, costs.in_flight[r], flops / whole))
    return ranks


def _block_params(m) -> int:
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return 2 * m.dim * q + 2 * m.dim * kv + 3 * m.dim * m.hidden_dim + 2 * m.dim


def pipeline_terms(
    config, s: Shape, layout: Layout, *, e: int, tokens: int, microbatches: int, offload: bool, ac: str
) -> PipelineTerms:
    """The heaviest pipeline rank's terms for micro-batches of ``tokens`` tokens, ``microbatches`` a step."""
    p = config.parallel
    schedule = p.pp_schedule
    v = p.pp_stages_per_rank if isinstance(p.pp_stages_per_rank, int) else (1 if schedule in ("1F1B", "GPipe") else 2)
    ranks = pipeline_ranks(config, layout, v, microbatches, schedule)
    costs = schedule_costs(COSTED_AS.get(schedule, schedule), layout.pp, microbatches, v)
    per_rank = [_rank_terms(r, s, layout, e, tokens, microbatches, offload) for r in ranks]
    # Each rank's state (AdamW's two moments beside its parameter shard), held activations, logits, buffers.
    rank_bytes = tuple(
        sum(parts.values()) + 2 * parts["param_shard"] + by_mode[ac] + logits + buffers
        for parts, by_mode, logits, buffers in per_rank
    )
    heaviest = max(range(len(ranks)), key=rank_bytes.__getitem__)
    parts, by_mode, logits_loss, buffers = per_rank[heaviest]
    boundary = tokens * s.d * e / layout.tp  # one micro-batch's hidden states between two stages
    return PipelineTerms(
        schedule=schedule,
        stages_per_rank=v,
        rank=ranks[heaviest],
        busiest=max(ranks, key=lambda r: r.flops_share),
        parts=parts,
        activations_by_mode=by_mode,
        logits_loss=logits_loss,
        buffers=buffers,
        bubble=costs.bubble,
        p2p_bytes=int(2 * microbatches * v * boundary),
        rank_bytes=rank_bytes,
    )


def _rank_terms(r: PipelineRank, s: Shape, layout: Layout, e: int, tokens: int, m: int, offload: bool):
    """(state parts, activations by mode, logits and loss, receive buffers) of pipeline rank ``r``."""
    tp, shard = layout.tp, layout.dp_shard * layout.cp  # FSDP shards over dp_shard x cp
    fsdp = layout.dp * layout.cp > 1 or e != 4 or offload  # as rayllm.parallel.apply.needs_fsdp
    param_shard = 4 * math.ceil(r.params / (shard * tp)) * (0 if offload else 1)
    parts = {
        "param_shard": param_shard,
        # Kept gathered for the whole step (reshard_after_forward=False), in compute dtype.
        "gathered": int(r.params / tp * e) if fsdp else 0,
        "grad_shard": param_shard,
        # The stage's unsharded fp32 gradients, accumulated over the micro-batches until one
        # reduce-scatter after the last, plus one block's in compute dtype as its backward makes it.
        "grad_unsharded": int((r.params * 4 + s.block * e) / tp) if fsdp else 0,
    }
    per_block = block_bytes_per_token(s, e, tp) * tokens
    held = r.in_flight * r.layers
    by_mode = {
        "off": int(held * per_block),
        "full": int(held * e * s.d * tokens / tp + per_block),
        "selective": int(held * selective_block_bytes_per_token(s, e, tp) * tokens + per_block),
    }
    # The last rank: one micro-batch's loss at its peak, as without a pipeline, beside what every
    # other micro-batch it holds keeps until its backward (GPipe: all of them).
    loss = loss_bytes_per_token(s, e, tp) + (r.in_flight - 1) * held_loss_bytes_per_token(s, e, tp)
    logits_loss = int(tokens * loss) if r.last else 0
    boundary = tokens * s.d * e / tp
    buffers = int(m * boundary * (2 - r.first - r.last))  # inputs but on the first, gradients but on the last
    return parts, by_mode, logits_loss, buffers
