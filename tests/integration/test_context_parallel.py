"""Context parallelism trains like one process: CP 2, CP 2 x FSDP 2, CP 2 x TP 2 and PP 2 x CP 2
under real torchrun gloo groups on CPU, fp32, with checkpoints resharding into and out of CP
layouts (rayllm/parallel/cp.py: torch's ring attention, the CPU flash kernel routed through it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import losses, quiet_run, torchrun_probe, torchrun_records, val_losses, walk_layouts

LEG_STEPS = 4
# data.seq_len 64: each of 2 CP ranks holds a head and a tail chunk of 16 positions of every
# sequence (under TP 2 as well, split along the sequence by SP inside a block's norms).
LEGS = {
    "fsdp2": (2, [], "FSDP 2"),
    "cp2": (2, ["parallel.cp=2"], "CP 2"),
    "cp2xfsdp2": (4, ["parallel.cp=2", "parallel.dp_shard=2"], "FSDP 2 x CP 2"),
    "cp2xtp2": (4, ["parallel.cp=2", "parallel.tp=2"], "CP 2 x TP 2"),
    # Two stages of one block each, 4 micro-batches a step, each split over the CP ranks.
    "pp2xcp2": (4, ["parallel.pp=2", "parallel.cp=2"], "PP 2 x CP 2"),
}
PROBE = Path(__file__).with_name("cp_probe.py")


@pytest.fixture
def base(overrides):
    return [*quiet_run(overrides), "train.val_every=4"]


def test_context_parallel_trains_like_one_process_and_reshards_to_and_from_other_layouts(base, tmp_path):
    """One run through FSDP 2 -> CP 2 -> CP 2 x FSDP 2 -> CP 2 x TP 2 -> PP 2 x CP 2 -> FSDP 2, LEG_STEPS
    steps each,
    each leg resuming the previous leg's checkpoint. Every step's training loss and every
    validation loss is the 1-process run's: the ring's attention over the split sequence, the
    rotary positions of each rank's chunks and the gradients' average over the CP ranks are right."""
    legs = ["fsdp2", "cp2", "cp2xfsdp2", "cp2xtp2", "pp2xcp2", "fsdp2"]
    steps = LEG_STEPS * len(legs)
    run = [*base, f"train.max_steps={steps}"]
    one = torchrun_records(1, [*run, f"run.dir={tmp_path / 'one'}"])
    assert sorted(losses(one)) == list(range(1, steps + 1)) and losses(one)[steps] < losses(one)[1]
    assert sorted(val_losses(one)) == list(range(0, steps + 1, LEG_STEPS))
    walk_layouts(run, legs, LEGS, LEG_STEPS, tmp_path / "legs", one)


@pytest.mark.parametrize(
    ("pp", "blocks_of_rank"),
    [
        (1, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}),  # CP 2: the whole model on both ranks
        (2, {0: [0, 2], 1: [0, 2], 2: [1, 3], 3: [1, 3]}),  # PP 2 x CP 2, Interleaved1F1B: stage s on pp rank s % 2
    ],
    ids=["cp2", "pp2xcp2"],
)
def test_every_block_sees_its_ranks_part_of_every_sequence(tmp_path, pp, blocks_of_rank):
    """CP 2, and PP 2 x CP 2 (Interleaved1F1B, 2 stages a rank), one step through the trainer's
    forward_backward: every block, in each micro-batch's forward, is given SEQ_LEN / 2 positions
    and a rotary table cut alike; the tables are whole again after the step. (The parity run
    cannot show this: FSDP averages the CP ranks' gradients of the same rows, so CP ranks that
    each trained whole sequences would match one process too.)"""
    ranks = torchrun_probe(PROBE, 2 * pp, tmp_path / "probe", str(pp), "2", "Interleaved1F1B")
    assert [r["rank"] for r in ranks] == list(blocks_of_rank)
    for r in ranks:
        assert sorted({s["block"] for s in r["seen"]}) == blocks_of_rank[r["rank"]], r
        assert {(s["tokens"], s["rope"]) for s in r["seen"]} == {(16, 16)}, r  # SEQ_LEN 32 over 2
        assert len(r["seen"]) >= len(blocks_of_rank[r["rank"]]) * 4, r  # each block, 4 micro-batches
        assert r["table_after"] == 32
    assert ranks[0]["loss"] != ranks[1]["loss"]  # each CP rank's part's mean
    assert ranks[0]["loss"] == ranks[-2]["loss"]  # on every stage of the pipeline
