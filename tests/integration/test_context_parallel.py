"""Context parallelism trains like one process: CP 2, CP 2 x FSDP 2 and CP 2 x TP 2 under real
torchrun gloo groups on CPU, fp32, with checkpoints resharding into and out of CP layouts
(rayllm/parallel/cp.py: torch's ring attention, the CPU flash kernel routed through it)."""

from __future__ import annotations

import pytest
from helpers import losses, quiet_run, torchrun_records, val_losses, walk_layouts

LEG_STEPS = 4
# data.seq_len 64: each of 2 CP ranks holds a head and a tail chunk of 16 positions of every
# sequence (under TP 2 as well, split along the sequence by SP inside a block's norms).
LEGS = {
    "fsdp2": (2, [], "FSDP 2"),
    "cp2": (2, ["parallel.cp=2"], "CP 2"),
    "cp2xfsdp2": (4, ["parallel.cp=2", "parallel.dp_shard=2"], "FSDP 2 x CP 2"),
    "cp2xtp2": (4, ["parallel.cp=2", "parallel.tp=2"], "CP 2 x TP 2"),
}


@pytest.fixture
def base(overrides):
    return [*quiet_run(overrides), "train.val_every=4"]


def test_context_parallel_trains_like_one_process_and_reshards_to_and_from_other_layouts(base, tmp_path):
    """One run through FSDP 2 -> CP 2 -> CP 2 x FSDP 2 -> CP 2 x TP 2 -> FSDP 2, LEG_STEPS steps each,
    each leg resuming the previous leg's checkpoint. Every step's training loss and every
    validation loss is the 1-process run's: the ring's attention over the split sequence, the
    rotary positions of each rank's chunks and the gradients' average over the CP ranks are right."""
    legs = ["fsdp2", "cp2", "cp2xfsdp2", "cp2xtp2", "fsdp2"]
    steps = LEG_STEPS * len(legs)
    run = [*base, f"train.max_steps={steps}"]
    one = torchrun_records(1, [*run, f"run.dir={tmp_path / 'one'}"])
    assert sorted(losses(one)) == list(range(1, steps + 1)) and losses(one)[steps] < losses(one)[1]
    assert sorted(val_losses(one)) == list(range(0, steps + 1, LEG_STEPS))
    walk_layouts(run, legs, LEGS, LEG_STEPS, tmp_path / "legs", one)
