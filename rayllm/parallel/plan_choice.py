"""``rayllm plan``'s choices: the layouts a cluster allows, the recommended plan among them
(rayllm.parallel.planner.plan_memory for each), and the report the CLI prints."""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import replace
from functools import partial

from rayllm.errors import ConfigError
from rayllm.parallel.gpus import GpuSpec
from rayllm.parallel.layout import CHECKPOINT_MODES, Layout
from rayllm.parallel.planner import (
    FULL_MATMUL_TOKENS,
    RECOMMEND_HEADROOM,
    MemoryPlan,
    check_split,
    gpu_spec,
    plan_memory,
)

# Context parallelism is weighed from this sequence length up. Below it a rank's chunk of a
# sequence is short enough that the ring's per-step latency and smaller attention kernels cost
# what the plan does not count, and TP splits the same compute (torchtitan and Megatron-LM
# use CP for contexts from 32k to 64k tokens up).
CP_MIN_SEQ_LEN = 32768


def candidate_layouts(config, nodes: int, gpus_per_node: int) -> list[Layout]:
    """FSDP over every GPU, and HSDP with one shard group per node, each with TP 1, 2, 4 or 8 inside a
    node; on several nodes also pipelines of whole nodes per stage (pp dividing the nodes), each
    stage laid out the same ways; for sequences of CP_MIN_SEQ_LEN tokens or more, context
    parallelism of 2, 4 or 8 beside TP inside a node, with or without a pipeline."""
    layouts = []
    pps = (p for p in range(1, nodes + 1) if nodes % p == 0)
    cps = (1, 2, 4, 8) if config.data.seq_len >= CP_MIN_SEQ_LEN else (1,)
    for tp, pp, cp in itertools.product((1, 2, 4, 8), pps, cps):
        if gpus_per_node % (tp * cp):
            continue
        stage_nodes = nodes // pp
        options = [Layout(1, stage_nodes * gpus_per_node // (tp * cp), tp, pp, cp)]
        options += [Layout(stage_nodes, gpus_per_node // (tp * cp), tp, pp, cp)] if stage_nodes > 1 else []
        for layout in options:
            try:
                check_split(layout, config)
            except ConfigError:
                continue
            layouts.append(layout)
    return layouts


PLANNED_SCHEDULES = ("1F1B", "Interleaved1F1B")  # what recommend() tries for a pipeline


def _with_schedules(config, pp: int) -> list:
    """``config`` as it is without a pipeline; with one, a copy per schedule recommend() tries."""
    if pp == 1:
        return [config]
    copies = []
    for schedule in PLANNED_SCHEDULES:
        scheduled = copy.copy(config)
        scheduled.parallel = replace(config.parallel, pp_schedule=schedule, pp_stages_per_rank="auto")
        copies.append(scheduled)
    return copies


def recommend(config, *, gpu: str | GpuSpec, nodes: int, gpus_per_node: int) -> MemoryPlan:
    """The plan with the shortest estimated step (MemoryPlan.step_seconds) that fits with
    RECOMMEND_HEADROOM to spare (else at all; else the smallest); among equal estimates, full
    matmuls (micro-batches of FULL_MATMUL_TOKENS tokens or more), then the least memory."""
    spec = gpu_spec(gpu)
    global_batch, seq = config.train.global_batch_size, config.data.seq_len
    plans = []
    for layout in candidate_layouts(config, nodes, gpus_per_node):
        per_rank = global_batch // layout.dp if global_batch % layout.dp == 0 else 0
        for scheduled, ac in itertools.product(_with_schedules(config, layout.pp), CHECKPOINT_MODES):
            plan = partial(plan_memory, scheduled, gpu=spec, nodes=nodes, gpus_per_node=gpus_per_node)
            for micro in (m for m in range(per_rank, 0, -1) if per_rank % m == 0):
                try:  # a pipeline's schedule may refuse this many micro-batches (rayllm.parallel.pp)
                    plans.append(plan(layout=layout, micro_batch=micro, activation_checkpointing=ac))
                except ConfigError:
                    continue
    if not plans:
        raise ConfigError(
            f"no layout of {nodes} x {gpus_per_node} GPUs splits train.global_batch_size {global_batch} and the model"
        )

    def preference(p: MemoryPlan) -> tuple:
        # Within 1% the estimates are the same: the model is not finer than that.
        return (
            round(math.log(p.step_seconds) / math.log(1.01)),
            -min(p.micro_batch * seq, FULL_MATMUL_TOKENS),
            p.total_bytes,
        )

    for ok in (lambda p: p.total_bytes <= RECOMMEND_HEADROOM * spec.memory_bytes, lambda p: p.fits):
        fitting = [p for p in plans if ok(p)]
        if fitting:
            return min(fitting, key=preference)
    return min(plans, key=lambda p: p.total_bytes)


LAYOUT_KEYS = ("dp_shard", "dp_replicate", "tp", "pp", "pp_schedule", "pp_stages_per_rank")


def parse_layout(text: str) -> dict[str, int | str]:
    """``tp=8,dp_replicate=2`` -> parallel settings to override."""
    pairs = [item.strip().partition("=")[::2] for item in text.split(",") if item.strip()]
    if not pairs or any(k.strip() not in LAYOUT_KEYS or not v.strip() for k, v in pairs):
        raise ConfigError(f"--layout {text!r}: write degrees as tp=8,dp_replicate=2 ({', '.join(LAYOUT_KEYS)})")
    return {k.strip(): int(v) if v.strip().isdigit() else v.strip() for k, v in pairs}


def report(
    config, *, gpu: str | None, nodes: int, gpus_per_node: int | None, micro_batch: int | None, layout: str | None
) -> str:
    """What ``rayllm plan`` prints: the config's own plan, and on GPUs the recommended one."""
    spec = gpu_spec(gpu)
    per_node = gpus_per_node or (8 if spec else config.worker_range[1])
    for name, value in (("--nodes", nodes), ("--gpus-per-node", per_node), ("--micro-batch", micro_batch or 1)):
        if value < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {value}")
    if layout:
        config.parallel = replace(config.parallel, **parse_layout(layout))
    plan = plan_memory(config, gpu=spec, nodes=nodes, gpus_per_node=per_node, micro_batch=micro_batch)
    where = f"{nodes} x {per_node} {spec.name}" if spec else f"{nodes * per_node} CPU rank(s)"
    out = [f"[{config.run.name} on {where}]", plan.format()]
    if spec:
        best = recommend(config, gpu=spec, nodes=nodes, gpus_per_node=per_node)
        out += ["recommended: " + best.summary(), "  " + best.comm_line()]
    return "\n".join(out)
