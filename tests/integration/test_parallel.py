"""Every parallel layout trains like one process: FSDP, HSDP, TP x FSDP and TP under real
torchrun gloo groups on CPU, fp32, and checkpoints reshard from any layout to any other."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import losses, quiet_run, torchrun_probe, torchrun_records, walk_layouts

LEG_STEPS = 5
# name: (ranks, overrides, the layout the run reports). Global batch 8: HSDP accumulates 2
# micro-batches of 1 (the cross-replica all-reduce waits for the last), TP x FSDP 2 of 2,
# TP alone 4 of 2.
LAYOUTS = {
    "fsdp4": (4, ["parallel.dp_shard=4"], "FSDP 4"),
    "hsdp2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch_size=1"], "HSDP 2x2"),
    "tp2xfsdp2": (4, ["parallel.tp=2", "train.activation_checkpointing=true", "train.compile=true"], "FSDP 2 x TP 2"),
    "tp2": (2, ["parallel.tp=2", "train.activation_checkpointing=selective", "train.compile=true"], "TP 2"),
}


@pytest.fixture
def base(overrides):
    return quiet_run(overrides)


def test_every_layout_trains_like_one_process_and_resumes_another_layouts_checkpoint(base, tmp_path):
    """One run through every layout, LEG_STEPS steps each, each leg resuming the previous leg's
    checkpoint: FSDP 4 from the start -> HSDP 2x2 -> TP 2 x FSDP 2 (full activation checkpointing,
    compiled blocks) -> TP 2 (selective checkpointing, compiled blocks) -> FSDP 4. Every step's
    loss is the 1-process run's (fp32), so each layout trains like one process and each
    checkpoint reshards to the next layout."""
    legs = ["fsdp4", "hsdp2x2", "tp2xfsdp2", "tp2", "fsdp4"]
    steps = LEG_STEPS * len(legs)
    run = [*base, f"train.max_steps={steps}"]
    one = torchrun_records(1, [*run, f"run.dir={tmp_path / 'one'}"])
    assert sorted(losses(one)) == list(range(1, steps + 1)) and losses(one)[steps] < losses(one)[1]
    walk_layouts(run, legs, LAYOUTS, LEG_STEPS, tmp_path / "legs", one)


# Measured after the probe's warm-up (the same path once on a tiny model): a 6 MB model
# (PROBE_DIM=64) gains 3-4 MiB at init on each of 4 ranks. The bound allows that and the
# largest parameter's full copy beside the shards, with room.
FIXED_INIT_BYTES = 16 * 2**20
PROBE = Path(__file__).with_name("parallel_probe.py")


def probe(tmp_path, *args: str) -> list[dict]:
    """parallel_probe.py (beside this file) on 4 torchrun ranks: one record per rank."""
    return torchrun_probe(PROBE, 4, tmp_path / "-".join(args), *args)


def test_init_and_accumulation_hold_a_ranks_share_of_the_model(tmp_path):
    """Meta-device init: a rank gains about its share of the weights, not the model. Accumulating
    4 micro-batches: gradients stay sharded after every one (FSDP's sync-off path, the
    comparison, holds the full unsharded gradients until the last)."""
    init = probe(tmp_path, "init")
    sharded, unsharded = probe(tmp_path, "accumulate", "sharded"), probe(tmp_path, "accumulate", "unsharded")
    assert len(init) == len(sharded) == len(unsharded) == 4
    for rank in init:
        share = rank["full_bytes"] / rank["world"]
        assert rank["full_bytes"] >= 4 * share and share > 2 * FIXED_INIT_BYTES
        assert rank["init_gain"] <= 1.5 * share + FIXED_INIT_BYTES, rank
    for rank in sharded:
        share = rank["full_bytes"] / rank["world"]
        assert rank["held_grad_bytes"] == [pytest.approx(share, rel=0.01)] * 4, rank
    for rank in unsharded:
        assert rank["held_grad_bytes"][:3] == [rank["full_bytes"]] * 3, rank
