"""Every parallel layout trains like one process: FSDP, HSDP, TP x FSDP and TP under real
torchrun gloo groups on CPU, fp32, and checkpoints reshard from any layout to any other."""

from __future__ import annotations

import pytest
from test_torchrun import losses, torchrun

STEPS = 6
# name: (ranks, overrides, the layout the run reports). Global batch 8: HSDP accumulates 2
# micro-batches of 1 (the cross-replica all-reduce waits for the last), TP x FSDP 2 of 2,
# TP alone 4 of 2.
LAYOUTS = {
    "fsdp4": (4, ["parallel.dp_shard=4"], "FSDP 4"),
    "hsdp2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch_size=1"], "HSDP 2x2"),
    "tp2xfsdp2": (4, ["parallel.tp=2", "train.activation_checkpointing=true"], "FSDP 2 x TP 2"),
    "tp2": (2, ["parallel.tp=2"], "TP 2"),
}


@pytest.fixture
def base(overrides):
    return [o for o in overrides if not o.startswith("run.dir=")] + [
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.val_every=100",
        "train.checkpoint_every=100",
        "train.sample_tokens=0",
        "tracking.enabled=false",
        "cluster.use_gpu=false",
    ]


def _close(a: dict[int, float], b: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(a[step] - b[step]) / b[step] <= 1e-4, (step, a[step], b[step])


def test_every_layout_gives_the_one_process_losses(base, tmp_path):
    one = losses(torchrun(1, [*base, f"run.dir={tmp_path / 'one'}"]))
    assert sorted(one) == list(range(1, STEPS + 1)) and one[STEPS] < one[1]
    for name, (nproc, layout, described) in LAYOUTS.items():
        records = torchrun(nproc, [*base, *layout, f"run.dir={tmp_path / name}"])
        start = next(r for r in records if r["kind"] == "start")
        assert (start["world_size"], start["layout"]) == (nproc, described), name
        _close(losses(records), one, range(1, STEPS + 1))


def test_a_checkpoint_resumes_under_any_other_layout(base, tmp_path):
    """One run through every layout, 2 steps each, each leg resuming the previous leg's
    checkpoint (FSDP 4 -> HSDP 2x2 -> TP 2 x FSDP 2 -> TP 2 -> FSDP 4): every step's loss is
    the uninterrupted run's."""
    legs = ["fsdp4", "hsdp2x2", "tp2xfsdp2", "tp2", "fsdp4"]
    steps = 2 * len(legs)
    run = [*base, f"train.max_steps={steps}"]
    full = losses(torchrun(1, [*run, f"run.dir={tmp_path / 'full'}"]))
    for i, name in enumerate(legs):
        nproc, layout, _ = LAYOUTS[name]
        stop = 2 * (i + 1)
        records = torchrun(nproc, [*run, *layout, f"run.dir={tmp_path / 'legs'}", f"train.stop_at_step={stop}"])
        start = [r for r in records if r["kind"] == "start"][-1]
        assert start["step"] == stop - 2, name
        resumed = losses(records[records.index(start) :])
        assert sorted(resumed) == [stop - 1, stop], name
        _close(resumed, full, resumed)
