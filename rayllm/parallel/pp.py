"""Pipeline stages: which layers each stage of the plain Llama holds, balanced by compute.

The embedding goes with the first stage and the final norm and head with the last (torchtitan's
split too). Unlike a split by layer count, each part is weighed by its training FLOPs per token:
the head's matmul is worth 2-3 blocks at 8B-70B (vocabulary 128k), so the last stage takes fewer
blocks. Stages are contiguous runs of layers, found by a small exact search (layers <= a few
hundred, stages <= a few dozen), not a greedy fill that can leave the last stage heavy.

``plan_pipeline`` settles the schedule, the stages each rank holds and the micro-batches, and
refuses by name what torch's schedules would refuse later (or silently get wrong);
``schedule_costs`` gives the planner a schedule's bubble and each rank's peak of held
activations, checked against torch's own Interleaved1F1B order in the tests. Building the stages
with torch is rayllm.parallel.pipeline's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch import nn

from rayllm.errors import ConfigError
from rayllm.model.shape import ModelShape


@dataclass(frozen=True)
class StagePart:
    """One pipeline stage's share of the plain model; its parameters keep the plain model's names."""

    index: int
    layers: range  # global block indices, contiguous
    first: bool  # holds the token embedding
    last: bool  # holds the final norm and the output head

    def holds(self, name: str) -> bool:
        """Whether the plain model's parameter ``name`` belongs to this stage."""
        if name.startswith("tok_embeddings."):
            return self.first
        if name.startswith(("norm.", "output.")):
            return self.last
        return int(name.split(".")[1]) in self.layers  # layers.<i>.…


@dataclass(frozen=True)
class PartCosts:
    """Training FLOPs per token of each part (6 x matmul weights, plus attention's own)."""

    block: float
    head: float
    embedding: float = 0.0  # a lookup: no matmul


def part_costs(shape: ModelShape, seq_len: int) -> PartCosts:
    """What each part costs per token: the same terms as ``flops_per_token``, split by part."""
    d, kv = shape.dim, shape.n_kv_heads * shape.head_dim
    block_weights = d * d * 2 + d * kv * 2 + 3 * d * shape.hidden_dim  # wq, wo; wk, wv; w1, w2, w3
    return PartCosts(block=6.0 * block_weights + 12.0 * d * seq_len, head=6.0 * d * shape.vocab_size)


def split_stages(shape: ModelShape, stages: int, seq_len: int) -> list[StagePart]:
    """``stages`` contiguous parts of the model whose heaviest stage is as light as it can be.
    Refuses, naming the fix, a split that would leave a stage without a block."""
    n = shape.n_layers
    if stages < 1:
        raise ConfigError(f"parallel.pp must be at least 1, got {stages}")
    if stages > n:
        raise ConfigError(
            f"{stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank) need at least one of the "
            f"model's {n} layers each: lower parallel.pp or parallel.pp_stages_per_rank"
        )
    costs = part_costs(shape, seq_len)
    bounds = _balanced_bounds(n, stages, costs)  # cached: a list never changed here
    return [
        StagePart(index=s, layers=range(bounds[s], bounds[s + 1]), first=s == 0, last=s == stages - 1)
        for s in range(stages)
    ]


def keep_stage(model: nn.Module, part: StagePart) -> nn.Module:
    """In place (on the meta device, before anything is allocated): the plain Llama reduced to
    ``part``. The blocks it keeps keep their global names, so a stage's state dict is a slice of
    the plain model's and checkpoints reshard across pipeline layouts."""
    for key in list(model.layers.keys()):
        if int(key) not in part.layers:
            del model.layers[key]
    if not part.first:
        model.tok_embeddings = None
    if not part.last:
        model.norm = None
        model.output = None
    return model


def stage_cost(part: StagePart, costs: PartCosts) -> float:
    return len(part.layers) * costs.block + costs.embedding * part.first + costs.head * part.last


@functools.cache  # the planner asks again for every candidate plan of one model
def _balanced_bounds(n: int, stages: int, costs: PartCosts) -> list[int]:
    """Cut points 0 = b0 < b1 < ... < b_stages = n minimising the heaviest stage (then the
    earliest stages lighter, which hold more micro-batches' activations under 1F1B)."""

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = costs.embedding * (stage == 0) + costs.head * (stage == stages - 1)
        return (hi - lo) * costs.block + extra

    # best[s][i]: the heaviest stage when the first i layers go to s + 1 stages, and where the
    # last of them begins (the earliest such cut on ties, so earlier stages hold no more).
    best = [[math.inf] * (n + 1) for _ in range(stages)]
    start = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):  # stage s holds layers j..i-1
                heaviest = max(best[s - 1][j], cost(s, j, i))
                if heaviest < best[s][i]:
                    best[s][i], start[s][i] = heaviest, j
    cuts, i = [n], n
    for s in range(stages - 1, 0, -1):
        i = start[s][i]
        cuts.append(i)
    return [0, *reversed(cuts)]


ONE_STAGE = ("1F1B", "GPipe")  # one stage per rank
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")  # rank r holds r, r + pp, ...
ZERO_BUBBLE = ("InterleavedZeroBubble",)  # backward split in two: refuse compiled stages
PIPELINE_SCHEDULES = (*ONE_STAGE, *LOOPED)  # torch 2.13's, by get_schedule_class's names
# Rank r holds stages r and 2 pp - 1 - r. torch 2.13's forward-only eval of these fails at the V's
# turn ("can't steal_bwd_input if this stage doesn't have backward"), so validation could not run.
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline's schedule and shape, settled before any stage is built."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int  # per step and data-parallel rank: the accumulation steps

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stage indices ``pp_rank`` holds, in the order its schedule expects them (looped)."""
        return list(range(pp_rank, self.n_stages, self.pp))


INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble")  # micro-batches in whole rounds of pp


def microbatches_fit(schedule: str, pp: int, microbatches: int) -> bool:
    """Whether torch's ``schedule`` takes ``microbatches`` per step over ``pp`` stages (fewer than
    pp would leave stages idle; the interleaved ones run whole rounds of pp)."""
    return microbatches >= pp and not (schedule in INTERLEAVED and microbatches % pp)


def plan_pipeline(settings, microbatches: int, n_layers: int, compile: bool) -> PipelinePlan:
    """``parallel.pp*`` (ParallelSettings) for a step of ``microbatches`` per data-parallel rank,
    or a one-line refusal naming the fix of what torch's schedule would refuse (or get wrong)."""
    pp, name = settings.pp, settings.pp_schedule
    schedule = next((s for s in PIPELINE_SCHEDULES if s.lower() == str(name).lower()), None)
    if str(name).lower() in (s.lower() for s in V_SHAPED):
        raise ConfigError(
            f"parallel.pp_schedule {name} is not supported: torch 2.13's V-shaped schedules fail in forward-only "
            "evaluation (validation); pick InterleavedZeroBubble or Interleaved1F1B"
        )
    if schedule is None:
        raise ConfigError(
            f"parallel.pp_schedule {name!r} is not one of {', '.join(PIPELINE_SCHEDULES)}; for example 1F1B"
        )
    per_rank = settings.pp_stages_per_rank
    if per_rank == "auto":
        per_rank = 1 if schedule in ONE_STAGE else 2
    if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1:
        raise ConfigError(f"parallel.pp_stages_per_rank must be a whole number >= 1 or auto, got {per_rank!r}")
    if schedule in ONE_STAGE and per_rank != 1:
        raise ConfigError(
            f"parallel.pp_schedule {schedule} runs 1 stage per rank, not {per_rank}: set "
            f"parallel.pp_stages_per_rank: 1 (or auto), or pick Interleaved1F1B for {per_rank}"
        )
    plan = PipelinePlan(schedule, pp, per_rank, microbatches)
    if plan.n_stages > n_layers:
        raise ConfigError(
            f"{plan.n_stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank) need at least one of the "
            f"model's {n_layers} layers each: lower parallel.pp or parallel.pp_stages_per_rank"
        )
    if pp > 1 and not microbatches_fit(schedule, pp, microbatches):
        what = f"a multiple of parallel.pp ({pp})" if schedule in INTERLEAVED else f"at least {pp}"
        raise ConfigError(
            f"parallel.pp_schedule {schedule} needs {what} micro-batches per step, got {microbatches} "
            "(train.global_batch_size / (train.micro_batch_size x data-parallel ranks)); raise the global batch or "
            "lower the micro-batch"
        )
    if pp > 1 and compile and schedule in ZERO_BUBBLE:
        raise ConfigError(
            f"parallel.pp_schedule {schedule} splits each backward in two, which torch does not do for compiled "
            "blocks; set train.compile: false, or pick 1F1B or Interleaved1F1B"
        )
    return plan


SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")  # those the planner can cost so far


@dataclass(frozen=True)
class ScheduleCosts:
    """What a pipeline schedule costs a step, for the planner."""

    bubble: float  # the fraction of a step each rank idles: fill and drain (textbook, B = 2F)
    in_flight: list[float]  # per pp rank: micro-batches whose activations it holds at its peak,
    # in units of one micro-batch through all of that rank's layers


def schedule_costs(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> ScheduleCosts:
    """The bubble and each rank's peak of held activations under ``schedule`` (torch 2.13's:
    GPipe runs every forward first; 1F1B's stage s warms up with min(m, pp - s) forwards;
    Interleaved1F1B warms up (v - 1) x (micro-batches per round) + 2 (pp - 1 - rank) chunks of
    1/v of the rank's layers, torch's _get_warmup_ops)."""
    m, v = microbatches, stages_per_rank
    if schedule not in SCHEDULES:
        raise ConfigError(f"the planner knows the pipeline schedules {', '.join(SCHEDULES)}, not {schedule!r}")
    if schedule != "Interleaved1F1B" and v != 1:
        raise ConfigError(f"{schedule} runs one stage per rank, got {v}")
    if schedule == "GPipe":
        return ScheduleCosts(bubble=(pp - 1) / (m + pp - 1), in_flight=[float(m)] * pp)
    if schedule == "1F1B":
        return ScheduleCosts(bubble=(pp - 1) / (m + pp - 1), in_flight=[float(min(m, pp - r)) for r in range(pp)])
    per_round = m // max(1, m // pp)
    warmup = [min((v - 1) * per_round + 2 * (pp - 1 - r), m * v) for r in range(pp)]
    in_flight = [min(w + 1, m * v) / v for w in warmup]  # the first steady forward comes before a backward
    return ScheduleCosts(bubble=(pp - 1) / (v * m + pp - 1), in_flight=in_flight)
