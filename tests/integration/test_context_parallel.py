"""Context parallelism trains like one process: CP 2, CP 2 x FSDP 2 and CP 2 x TP 2 under real
torchrun gloo groups on CPU, fp32, with checkpoints resharding into and out of CP layouts
(rayllm/parallel/cp.py: torch's ring attention, the CPU flash kernel routed through it)."""

from __future__ import annotations

import pytest
from helpers import assert_close, losses, quiet_run, torchrun_records, val_losses

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
    one_records = torchrun_records(1, [*run, f"run.dir={tmp_path / 'one'}"])
    one, one_val = losses(one_records), val_losses(one_records)
    assert sorted(one) == list(range(1, steps + 1)) and one[steps] < one[1]
    for i, name in enumerate(legs):
        nproc, layout, described = LEGS[name]
        stop = LEG_STEPS * (i + 1)
        records = torchrun_records(nproc, [*run, *layout, f"run.dir={tmp_path / 'legs'}", f"train.stop_at_step={stop}"])
        start = [r for r in records if r["kind"] == "start"][-1]
        assert (start["step"], start["world_size"], start["layout"]) == (stop - LEG_STEPS, nproc, described)
        trained = records[records.index(start) :]
        assert sorted(losses(trained)) == list(range(stop - LEG_STEPS + 1, stop + 1)), name
        assert_close(losses(trained), one, losses(trained))
        assert stop in val_losses(trained), name
        assert_close(val_losses(trained), one_val, [stop])
