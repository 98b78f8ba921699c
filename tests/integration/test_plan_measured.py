"""`rayllm plan` against what PyTorch measures: the planned CPU peak against a real Trainer's steps, and
each planned term against the live bytes PyTorch's profiler sees, on one rank and on each rank of a
pipeline (the arithmetic alone: tests/unit/test_plan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import torchrun_probe
from pp_memory_probe import MODEL, pipeline_config

from rayllm.config import TrainConfig
from rayllm.parallel.planner import plan_memory

# One rank of the CPU model (pp_memory_probe.py's), 2 micro-batches a step, so gradients coexist
# with activations.
CPU_MODEL = [*MODEL, "train.global_batch_size=8", "cluster.num_workers=1"]


def test_plan_agrees_with_measured_cpu_peak():
    from rayllm.bench.speed import run_ranks

    config = TrainConfig.from_yaml("configs/tiny.yaml", CPU_MODEL)
    plan = plan_memory(config, gpu=None, nodes=1, gpus_per_node=1, framework_bytes=0)
    planned = plan.total_bytes - plan.breakdown["framework_reserve"]
    # The Trainer's real steps in a fresh process: its peak resident memory above what it held before
    # it built the model (torch imported). Step 2 is the first with AdamW's state from the start.
    measured = run_ranks(config, 1, 2, threads=1)["peak_bytes"]
    error = planned / measured - 1
    print(
        f"\nrayllm plan on the tiny config (scaled up: dim 512, 8 layers) agrees with the measured CPU peak "
        f"within 15%: planned {planned:,} bytes, measured {measured:,} bytes ({error:+.1%})"
    )
    print(plan.format())
    assert abs(error) < 0.15
    # The check can fail: the planner without its optimizer term would be off by more than 15%.
    assert abs((planned - plan.breakdown["optimizer"]) / measured - 1) > 0.15


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_terms_are_the_live_bytes_pytorch_allocates(checkpointing):
    """Without the heap's slack, the terms are the bytes PyTorch's profiler sees live at the step's peak."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rayllm.bench.common import bench_trainer, synthetic_rows

    small = ["model.dim=256", "model.n_layers=2", "data.seq_len=128", f"train.activation_checkpointing={checkpointing}"]
    config = TrainConfig.from_yaml("configs/tiny.yaml", CPU_MODEL + small)
    trainer = bench_trainer(config, 0, 1, torch.device("cpu"))
    rows = synthetic_rows(config, config.train.global_batch_size)
    trainer.train_step(rows)  # AdamW's state exists from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(rows)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    plan = plan_memory(config, gpu=None, nodes=1, gpus_per_node=1, framework_bytes=0)
    b = plan.breakdown
    peak += b["parameters"] + b["optimizer"]  # held before the step starts
    counted = sum(b[k] for k in ("parameters", "gradients", "optimizer", "activations", "logits_loss"))
    print(f"\nactivation checkpointing {checkpointing}: live peak {peak:,} bytes, planned {counted:,} bytes")
    if not checkpointing:
        assert peak == pytest.approx(counted, rel=0.01)
    else:
        # The recomputed block and the loss's logits never coexist: the sum errs high by one of them.
        recomputed = b["activations"] - 2 * 4 * 256 * 4 * 128  # less the 2 blocks' saved fp32 inputs
        assert peak <= counted <= peak + min(recomputed, b["logits_loss"]) * 1.05


PIPELINE_PROBE = Path(__file__).with_name("pp_memory_probe.py")


@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B"])
def test_each_pipeline_rank_holds_what_the_planner_counts_for_it(tmp_path, schedule):
    """PP 2 of the CPU model, 4 micro-batches a step, under real torchrun gloo ranks: each rank's live
    bytes at its step's peak (PyTorch's profiler, over what it held before: its stages' parameters
    and AdamW's state) are the planner's count for that rank within 6%. GPipe holds every
    micro-batch's activations (and, on the last rank, their logits); Interleaved1F1B puts two
    stages on each rank and holds fewer."""
    ranks = torchrun_probe(PIPELINE_PROBE, 2, tmp_path / "probe", schedule, "4")
    plan = plan_memory(pipeline_config(schedule, 4), gpu=None, nodes=1, gpus_per_node=2, framework_bytes=0)
    measured = [r["step_peak"] + r["held"] for r in ranks]
    planned = plan.pipeline.rank_bytes
    print(f"\n{schedule}: measured {measured}, planned {list(planned)} bytes by pipeline rank")
    for rank, (m, p) in enumerate(zip(measured, planned, strict=True)):
        assert abs(m / p - 1) <= 0.06, (rank, m, p)
    # The check can fail: the schedule's held micro-batches are most of it (1F1B holds 2 and 1).
    one_f_one_b = plan_memory(pipeline_config("1F1B", 4), gpu=None, nodes=1, gpus_per_node=2, framework_bytes=0)
    if schedule == "GPipe":
        assert all(abs(m / p - 1) > 0.3 for m, p in zip(measured, one_f_one_b.pipeline.rank_bytes, strict=True))
