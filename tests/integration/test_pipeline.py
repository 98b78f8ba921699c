"""Pipeline parallelism trains like one process: PP 2 (1F1B, interleaved zero-bubble), PP 2 x FSDP 2 and
PP 2 x TP 2 (interleaved 1F1B) under real torchrun gloo groups on CPU, fp32, with checkpoints
resharding into and out of pipelines (rayllm/parallel/pipeline.py)."""

from __future__ import annotations

import pytest
from helpers import losses, quiet_run, torchrun_records, val_losses, walk_layouts

LEG_STEPS = 5
# Four blocks: an interleaved schedule of 2 stages per rank over 2 ranks holds one block a stage.
# Global batch 8 of micro-batches of 2: a pipeline without data parallelism runs 4 micro-batches
# a step, PP 2 x FSDP 2 runs 2 per data-parallel rank.
FOUR_BLOCKS = ["model.n_layers=4", "train.val_every=5"]
LEGS = {
    "fsdp2": (2, [], "FSDP 2"),
    "pp2": (2, ["parallel.pp=2"], "PP 2"),
    "pp2-zero-bubble": (2, ["parallel.pp=2", "parallel.pp_schedule=InterleavedZeroBubble"], "PP 2"),
    "pp2xfsdp2": (4, ["parallel.pp=2", "parallel.dp_shard=2"], "PP 2 x FSDP 2"),
    "pp2xtp2-interleaved": (
        4,
        ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=Interleaved1F1B"],
        "PP 2 x TP 2",
    ),
}


@pytest.fixture
def base(overrides):
    return [*quiet_run(overrides), *FOUR_BLOCKS]


def test_pipelines_train_like_one_process_and_reshard_to_and_from_other_layouts(base, tmp_path):
    """One run through FSDP 2 -> PP 2 (1F1B) -> PP 2 x FSDP 2 -> PP 2 x TP 2 (Interleaved1F1B, two
    stages a rank) -> PP 2 (InterleavedZeroBubble) -> FSDP 2, LEG_STEPS steps each, each leg resuming the
    previous leg's checkpoint. Every step's training loss and every validation loss (run through
    the schedule's forward-only eval) is the 1-process run's."""
    legs = ["fsdp2", "pp2", "pp2xfsdp2", "pp2xtp2-interleaved", "pp2-zero-bubble", "fsdp2"]
    steps = LEG_STEPS * len(legs)
    run = [*base, f"train.max_steps={steps}"]
    one = torchrun_records(1, [*run, f"run.dir={tmp_path / 'one'}"])
    assert sorted(losses(one)) == list(range(1, steps + 1)) and losses(one)[steps] < losses(one)[1]
    assert sorted(val_losses(one)) == list(range(0, steps + 1, LEG_STEPS))
    walk_layouts(run, legs, LEGS, LEG_STEPS, tmp_path / "legs", one)
