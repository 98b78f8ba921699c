"""Every parallel layout trains like one process: FSDP, HSDP, TP x FSDP and TP under real
torchrun gloo groups on CPU, fp32, and checkpoints reshard from any layout to any other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, losses, torchrun_records

LEG_STEPS = 5
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


def test_every_layout_trains_like_one_process_and_resumes_another_layouts_checkpoint(base, tmp_path):
    """One run through every layout, LEG_STEPS steps each, each leg resuming the previous leg's
    checkpoint: FSDP 4 from the start -> HSDP 2x2 -> TP 2 x FSDP 2 (activation checkpointing) ->
    TP 2 -> FSDP 4. Every step's loss is the 1-process run's (fp32), so each layout trains like
    one process and each checkpoint reshards to the next layout."""
    legs = ["fsdp4", "hsdp2x2", "tp2xfsdp2", "tp2", "fsdp4"]
    steps = LEG_STEPS * len(legs)
    run = [*base, f"train.max_steps={steps}"]
    one = losses(torchrun_records(1, [*run, f"run.dir={tmp_path / 'one'}"]))
    assert sorted(one) == list(range(1, steps + 1)) and one[steps] < one[1]
    for i, name in enumerate(legs):
        nproc, layout, described = LAYOUTS[name]
        stop = LEG_STEPS * (i + 1)
        records = torchrun_records(nproc, [*run, *layout, f"run.dir={tmp_path / 'legs'}", f"train.stop_at_step={stop}"])
        start = [r for r in records if r["kind"] == "start"][-1]
        assert (start["step"], start["world_size"], start["layout"]) == (stop - LEG_STEPS, nproc, described)
        trained = losses(records[records.index(start) :])
        assert sorted(trained) == list(range(stop - LEG_STEPS + 1, stop + 1)), name
        _close(trained, one, trained)


# Measured after the probe's warm-up (the same path once on a tiny model): a 6 MB model
# (PROBE_DIM=64) gains 3-4 MiB at init on each of 4 ranks. The bound allows that and the
# largest parameter's full copy beside the shards, with room.
FIXED_INIT_BYTES = 16 * 2**20
PROBE = Path(__file__).with_name("parallel_probe.py")


def probe(tmp_path, *args: str) -> list[dict]:
    """parallel_probe.py (beside this file) on 4 torchrun ranks: one record per rank."""
    out = tmp_path / "-".join(args)
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(PROBE),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PROBE_OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


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


# -- layouts: degrees, elastic world sizes, refusals (pure, no processes) ----------------------
def _config(*overrides: str):
    from rayllm.config import TrainConfig

    return TrainConfig.from_dict({}, overrides=list(overrides))


def test_auto_degrees_follow_the_world_and_its_nodes():
    from rayllm.parallel.layout import Layout, resolve_layout

    p = _config().parallel
    assert resolve_layout(p, 4) == Layout(1, 4, 1)  # CPU: FSDP over everything
    assert resolve_layout(p, 16, ranks_per_node=8, use_gpu=True) == Layout(2, 8, 1)  # HSDP: shard in a node
    assert resolve_layout(p, 8, ranks_per_node=8, use_gpu=True) == Layout(1, 8, 1)
    tp = _config("parallel.tp=auto").parallel
    assert resolve_layout(tp, 64, ranks_per_node=8, n_params=70e9, use_gpu=True) == Layout(8, 1, 8)
    assert resolve_layout(tp, 64, ranks_per_node=8, n_params=8e9, use_gpu=True) == Layout(8, 8, 1)
    fixed = _config(
        "parallel.dp_shard=2", "parallel.tp=2", "cluster.num_workers=8", "train.micro_batch_size=4"
    ).parallel
    assert resolve_layout(fixed, 8) == Layout(2, 2, 2)
    assert Layout(2, 2, 2).data_rank(5) == 2  # ranks 4 and 5 are one TP group: slice 2 of 4


def test_an_elastic_run_takes_only_world_sizes_the_layout_and_batch_allow():
    import ray.train

    from rayllm.parallel.layout import usable_world_sizes
    from rayllm.runtime.ray_trainer import WholeLayoutsPolicy

    c = _config("parallel.tp=2", "cluster.num_workers=[2, 8]", "train.global_batch_size=16", "train.micro_batch_size=1")
    usable = usable_world_sizes(c.parallel, 2, 8, 16, 1)
    assert usable == [2, 4, 8]  # 6 ranks are 3 slices: 16 sequences do not split in 3
    scaling = ray.train.ScalingConfig(num_workers=(2, 8), resources_per_worker={"CPU": 1})
    policy = WholeLayoutsPolicy(scaling, usable)
    assert policy._count_possible_workers({"a": {"CPU": 5.0}, "b": {"CPU": 2.0}}) == 4  # room for 7
    assert policy._count_possible_workers({"a": {"CPU": 1.0}}) == 0  # below the minimum: wait


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tp=3", "cluster.num_workers=3"], "parallel.tp 3 must divide model.n_heads"),
        (["parallel.tp=2", "model.tie_embeddings=true"], "tie_embeddings is not supported"),
        (["parallel.dp_shard=3", "cluster.num_workers=4"], "does not lay out 4 ranks"),
        (["parallel.tp=0"], "parallel.tp must be a whole number >= 1 or auto"),
        (["parallel.tp=2", "train.compile=true"], "train.compile: true with parallel.tp > 1 is not supported"),
        (
            ["parallel.tp=2", "cluster.num_workers=4", "train.global_batch_size=6", "train.micro_batch_size=2"],
            "data-parallel ranks",
        ),
    ],
)
def test_layouts_that_cannot_work_are_refused_before_any_worker_starts(overrides, message):
    from rayllm.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _config(*overrides)
