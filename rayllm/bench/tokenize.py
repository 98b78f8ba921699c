"""``rayllm bench tokenize``: data wait when a run consumes at a given rate, with the tokenize
tasks sized by the pipeline itself (data/encode.py).

A consumer takes global batches from rayllm's Ray path at a fixed demand (it sleeps for
the step time the demand implies, as a training step would) and measures how long it waits
for each batch. Demands are given as multiples of one core's raw ``encode_batch`` rate on
this machine, so the figures say what sizing does where one reading task alone cannot keep
up (above 1.0) and where it need not start any task (well below). Each demand runs on a
fresh seed, so its reading tasks start unsized.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from rayllm.bench.data import raw_encode
from rayllm.config import TrainConfig
from rayllm.data.discover import prepare_data
from rayllm.data.order import DataState, open_stream

BATCH_ROWS = 64  # rows per simulated global batch


def paced(plan, demand: float, seconds: float, tokenize_tasks: int) -> dict[str, Any]:
    """Consume ``plan`` at ``demand`` tokens/s for ``seconds`` after the first batch."""
    from rayllm.data.stream.pipeline import DATA_TASK_CPUS, ray_chunks

    produce = ray_chunks(tokenize_tasks, cpus_per_task=DATA_TASK_CPUS, env={"RAYON_NUM_THREADS": "1"})
    tasks_seen: list[tuple[float, int]] = []

    def chunks(source, cursor):
        for chunk in produce(source, cursor):
            tasks_seen.append((time.perf_counter(), int(np.max(chunk["tokenize_tasks"]))))
            yield chunk

    stream = open_stream(plan, DataState(), consumed=0, global_batch=BATCH_ROWS, chunks=chunks)
    tokens_per_step = BATCH_ROWS * (plan.sources[0].seq_len + 1)
    step_s = tokens_per_step / demand
    start = time.perf_counter()
    next(stream)
    first = time.perf_counter() - start
    steps: list[tuple[float, float]] = []  # (when the step began, seconds waited for its batch)
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        asked = time.perf_counter()
        next(stream)
        got = time.perf_counter()
        steps.append((asked, got - asked))
        time.sleep(max(0.0, step_s - (time.perf_counter() - got)))  # the simulated compute
    stream.close()
    end = time.perf_counter()
    half = begin + seconds / 2
    late = [w for t, w in steps if t >= half]
    late_tasks = [k for t, k in tasks_seen if t >= half]
    return {
        "demand_tokens_per_s": demand,
        "served_tokens_per_s": len(steps) * tokens_per_step / (end - begin),
        "served_tokens_per_s_second_half": len(late) * tokens_per_step / max(1e-9, end - half),
        "seconds_to_first_batch": first,
        "wait_frac": sum(w for _, w in steps) / (end - begin),
        "wait_frac_second_half": sum(late) / max(1e-9, end - half),
        "tokenize_tasks": max(late_tasks) if late_tasks else (tasks_seen[-1][1] if tasks_seen else 0),
    }


def run(
    config: TrainConfig, cpus: int, multiples: tuple[float, ...], seconds: float, tokenize_tasks: int
) -> dict[str, Any]:
    plans = prepare_data(config, log=lambda *_: None)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from rayllm.data.stream.pipeline import configure_ray_data

    if not ray.is_initialized():
        ray.init(num_cpus=cpus, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="WARNING")
    configure_ray_data()
    one_core = raw_encode(plans.train, threads=1, epochs=1)["tokens_per_s"]
    rows = []
    for i, multiple in enumerate(multiples):
        # A new seed: fresh reading tasks; enough epochs in one Ray Data execution for the whole run, as
        # the driver plans them for a training run (a pass boundary is a gap a run pays rarely).
        seed = plans.train.seed + 1000 + i
        sources = [dataclasses.replace(s, seed=seed, epochs_per_pass=100) for s in plans.train.sources]
        plan = dataclasses.replace(plans.train, seed=seed, sources=sources)
        rows.append({"multiple": multiple, **paced(plan, multiple * one_core, seconds, tokenize_tasks)})
    return {"cpus": cpus, "one_core_tokens_per_s": one_core, "ceiling": tokenize_tasks, "rows": rows}


def format_result(r: dict[str, Any]) -> str:
    lines = [
        f"[rayllm bench tokenize] {r['cpus']} CPU(s); one core's raw encode_batch: "
        f"{r['one_core_tokens_per_s']:,.0f} tokens/s; data.tokenize_tasks (ceiling) = {r['ceiling']}",
        f"  {'demand':>8} {'tokens/s':>11} {'served':>11} {'wait %':>7} {'wait % (2nd half)':>18} "
        f"{'tasks':>6} {'first batch':>12}",
    ]
    for row in r["rows"]:
        lines.append(
            f"  {row['multiple']:>7.2f}x {row['demand_tokens_per_s']:>11,.0f} {row['served_tokens_per_s']:>11,.0f} "
            f"{100 * row['wait_frac']:>7.2f} {100 * row['wait_frac_second_half']:>18.2f} "
            f"{row['tokenize_tasks']:>6} {row['seconds_to_first_batch']:>11.1f}s"
        )
    lines.append("  goal: wait <= 2% of step time once sized (second half), with tasks only where demand needs them")
    return "\n".join(lines)
