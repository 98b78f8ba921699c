"""Parallel layouts without processes: the auto degrees for a world and its nodes, the world sizes an
elastic run may take, and the layouts refused before any worker starts (trained under torchrun in
tests/integration/test_parallel.py)."""

from __future__ import annotations

import pytest


def _config(*overrides: str):
    from rayllm.config import TrainConfig

    return TrainConfig.from_dict({}, overrides=list(overrides))


def test_auto_degrees_follow_the_world_and_its_nodes():
    from rayllm.data.order import DataSlicing
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
    slicing = DataSlicing(8, ranks_per_slice=2)  # Layout(2, 2, 2)'s
    assert slicing.slice_of(5) == 2  # ranks 4 and 5 are one TP group: slice 2 of 4
    # A pipeline is the outermost axis: the other degrees lay out each stage's ranks.
    pp = _config("parallel.pp=2", "cluster.num_workers=8", "train.micro_batch_size=1").parallel
    assert resolve_layout(pp, 8) == Layout(1, 4, 1, pp=2)
    assert resolve_layout(pp, 32, ranks_per_node=8, use_gpu=True) == Layout(2, 8, 1, pp=2)  # HSDP per stage
    assert Layout(1, 2, 2, pp=2).describe() == "PP 2 x FSDP 2 x TP 2"
    staged = DataSlicing(8, ranks_per_slice=2, stages=2)  # Layout(1, 2, 2, pp=2)'s
    assert [staged.slice_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [r for r in range(8) if staged.records(r)] == [0, 2]  # the first stage's first TP ranks
    # Context parallelism sits beside TP: cp x tp neighbours share rows, each its part of them.
    cp = _config("parallel.cp=2", "cluster.num_workers=8", "train.micro_batch_size=1").parallel
    assert resolve_layout(cp, 8) == Layout(1, 4, 1, cp=2)
    assert resolve_layout(cp, 32, ranks_per_node=8, use_gpu=True) == Layout(4, 4, 1, cp=2)  # HSDP, CP in a node
    assert Layout(2, 2, 2, cp=2).describe() == "HSDP 2x2 x CP 2 x TP 2"
    assert [DataSlicing(8, ranks_per_slice=4).slice_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # And inside each pipeline stage: the stages and the CP ranks of a replica share its rows.
    pp_cp = _config("parallel.pp=2", "parallel.cp=2", "cluster.num_workers=8", "train.micro_batch_size=1").parallel
    assert resolve_layout(pp_cp, 8) == Layout(1, 2, 1, pp=2, cp=2)
    assert Layout(1, 2, 1, pp=2, cp=2).describe() == "PP 2 x FSDP 2 x CP 2"
    assert [DataSlicing(8, ranks_per_slice=2, stages=2).slice_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


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
    # A pipeline grows by whole replicas: every stage gains a rank.
    pp = _config(
        "parallel.pp=2", "cluster.num_workers=[2, 8]", "train.global_batch_size=16", "train.micro_batch_size=1"
    )
    assert usable_world_sizes(pp.parallel, 2, 8, 16, 1) == [2, 4, 8]
    # Interleaved: 12 sequences are 12, 6 and 4 micro-batches at 2, 4 and 6 ranks (whole rounds of
    # pp 2), but 3 at 8 ranks, which an interleaved schedule refuses.
    looped = _config(
        "parallel.pp=2",
        "parallel.pp_schedule=Interleaved1F1B",
        "cluster.num_workers=2",
        "train.global_batch_size=12",
        "train.micro_batch_size=1",
    )
    assert usable_world_sizes(looped.parallel, 2, 8, 12, 1) == [2, 4, 6]
    cp = _config(
        "parallel.cp=2", "cluster.num_workers=[2, 8]", "train.global_batch_size=16", "train.micro_batch_size=1"
    )
    assert usable_world_sizes(cp.parallel, 2, 8, 16, 1) == [2, 4, 8]  # by whole CP groups


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tp=3", "cluster.num_workers=3"], "parallel.tp 3 must divide model.n_heads"),
        (["parallel.tp=2", "model.tie_embeddings=true"], "tie_embeddings is not supported"),
        (["parallel.dp_shard=3", "cluster.num_workers=4"], "does not lay out 4 ranks"),
        (["parallel.tp=0"], "parallel.tp must be a whole number >= 1 or auto"),
        (["parallel.pp=3", "cluster.num_workers=4"], "parallel.pp 3 does not divide the 4 workers"),
        (["parallel.pp=2", "model.tie_embeddings=true"], "parallel.pp > 1 with model.tie_embeddings is not supported"),
        (
            ["parallel.pp=2", "train.global_batch_size=8", "train.micro_batch_size=8"],
            "parallel.pp_schedule 1F1B needs at least 2 micro-batches",
        ),
        (
            ["parallel.cp=2", "data.seq_len=250"],
            r"parallel.cp 2 needs data.seq_len \(250\) to be a multiple of 2 x cp x tp \(4\)",
        ),
        (["parallel.cp=0"], "parallel.cp must be"),
        (["parallel.cp=2", "cluster.use_gpu=true", "train.precision=fp32"], "with train.precision fp32 on GPUs"),
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
