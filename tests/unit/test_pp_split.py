"""Pipeline stages (parallel/pp.py): every layer in exactly one stage, contiguous, the embedding
with the first and the head with the last, balanced by each part's FLOPs (the exact optimum, checked
against every possible split), and a split that would leave a stage empty refused by name."""

from __future__ import annotations

import itertools

import pytest
import torch

from rayllm.config import TrainConfig
from rayllm.errors import ConfigError
from rayllm.model.llama import Llama
from rayllm.model.shape import ModelArgs, ModelShape
from rayllm.parallel.pp import part_costs, schedule_costs, split_stages, stage_cost


def _shape(name: str) -> ModelShape:
    return TrainConfig.from_yaml(f"configs/{name}.yaml").model


def test_stages_cover_every_layer_once_in_order_with_embedding_first_and_head_last():
    parts = split_stages(_shape("llama-8b"), 4, seq_len=8192)
    assert [p.index for p in parts] == [0, 1, 2, 3]
    assert [i for p in parts for i in p.layers] == list(range(32))
    assert [(p.first, p.last) for p in parts] == [(True, False), (False, False), (False, False), (False, True)]


def test_the_head_weighs_as_blocks_do_so_the_last_stage_holds_fewer():
    shape = _shape("llama-8b")
    costs = part_costs(shape, 8192)
    assert 1.5 < costs.head / costs.block < 3  # 4096 x 128256 against a block's weights and attention
    parts = split_stages(shape, 4, seq_len=8192)
    assert len(parts[-1].layers) < len(parts[0].layers)
    heaviest = max(stage_cost(p, costs) for p in parts)
    ideal = (32 * costs.block + costs.head) / 4
    assert ideal <= heaviest < ideal + costs.block


@pytest.mark.parametrize(("n_layers", "stages", "vocab"), [(7, 3, 50_000), (9, 4, 4096), (6, 2, 200_000), (5, 5, 4096)])
def test_the_split_is_the_best_possible(n_layers, stages, vocab):
    """Against every way to cut n layers into contiguous non-empty stages."""
    shape = ModelShape(dim=256, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=vocab)
    costs = part_costs(shape, 512)
    parts = split_stages(shape, stages, seq_len=512)
    found = max(stage_cost(p, costs) for p in parts)

    def heaviest(cuts):
        bounds = [0, *cuts, n_layers]
        loads = [(bounds[s + 1] - bounds[s]) * costs.block for s in range(stages)]
        loads[-1] += costs.head
        return max(loads)

    best = min(heaviest(c) for c in itertools.combinations(range(1, n_layers), stages - 1))
    assert found == pytest.approx(best)
    assert all(len(p.layers) >= 1 for p in parts)


def test_a_small_vocabulary_splits_evenly():
    shape = ModelShape(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256)
    assert [list(p.layers) for p in split_stages(shape, 2, seq_len=64)] == [[0, 1], [2, 3]]


def test_every_parameter_of_the_plain_model_belongs_to_exactly_one_stage():
    args = ModelArgs(dim=64, n_layers=5, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=64)
    with torch.device("meta"):
        names = [name for name, _ in Llama(args).named_parameters()]
    parts = split_stages(args, 3, seq_len=64)
    for name in names:
        assert sum(p.holds(name) for p in parts) == 1, name


def test_more_stages_than_layers_is_refused_naming_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"^5 pipeline stages \(parallel.pp x parallel.pp_stages_per_rank\) need at least one of the model's 4 "
        r"layers each: lower parallel.pp or parallel.pp_stages_per_rank$",
    ):
        split_stages(ModelShape(n_layers=4), 5, seq_len=64)


def _parallel(*overrides: str):
    from rayllm.config import TrainConfig

    return TrainConfig.from_dict({}, overrides=["train.micro_batch_size=1", "model.n_layers=8", *overrides]).parallel


def test_a_pipeline_plan_places_stages_as_its_schedule_expects():
    from rayllm.parallel.pp import plan_pipeline

    one = plan_pipeline(_parallel("parallel.pp=4", "cluster.num_workers=4"), 8, n_layers=8, compile=True)
    assert (one.schedule, one.stages_per_rank, one.n_stages, one.stages_of(2)) == ("1F1B", 1, 4, [2])
    looped = plan_pipeline(_parallel("parallel.pp=2", "parallel.pp_schedule=interleaved1f1b"), 4, 8, False)
    assert (looped.schedule, looped.n_stages, looped.stages_of(0), looped.stages_of(1)) == (
        "Interleaved1F1B",
        4,
        [0, 2],
        [1, 3],
    )
    three = plan_pipeline(
        _parallel("parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=3"), 4, 8, False
    )
    assert three.stages_of(1) == [1, 3, 5]


@pytest.mark.parametrize(
    ("overrides", "microbatches", "compile", "message"),
    [
        (
            ["parallel.pp_schedule=Zigzag"],
            4,
            False,
            r"parallel.pp_schedule 'Zigzag' is not one of 1F1B, GPipe, .*; for example 1F1B$",
        ),
        (
            ["parallel.pp_stages_per_rank=2"],
            4,
            False,
            r"parallel.pp_schedule 1F1B runs 1 stage per rank, not 2: set ",
        ),
        (
            ["parallel.pp_schedule=DualPipeV"],
            4,
            False,
            r"DualPipeV is not supported: torch 2.13's V-shaped schedules fail in forward-only evaluation",
        ),
        (
            ["parallel.pp_stages_per_rank=0"],
            4,
            False,
            r"parallel.pp_stages_per_rank must be a whole number >= 1 or auto",
        ),
        ([], 1, False, r"1F1B needs at least 2 micro-batches per step, got 1 \(train.global_batch_size / "),
        (
            ["parallel.pp_schedule=Interleaved1F1B"],
            3,
            False,
            r"Interleaved1F1B needs a multiple of parallel.pp \(2\) micro",
        ),
        (
            ["parallel.pp_schedule=InterleavedZeroBubble"],
            4,
            True,
            r"InterleavedZeroBubble splits each backward in two, .*set train.compile: false",
        ),
        (["parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=4"], 4, False, r"^8 pipeline stages"),
    ],
)
def test_a_pipeline_torch_would_refuse_is_refused_first_in_one_line(overrides, microbatches, compile, message):
    from rayllm.parallel.pp import plan_pipeline

    with pytest.raises(ConfigError, match=message) as e:
        plan_pipeline(_parallel("parallel.pp=2", *overrides), microbatches, n_layers=6, compile=compile)
    assert "\n" not in str(e.value)


def _torch_interleaved_peaks(pp: int, m: int, v: int) -> list[float]:
    """Each rank's peak of forward chunks awaiting their backward, in torch's own Interleaved1F1B
    order (its per-rank action list, computed as its constructor does, without stages)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    order = object.__new__(ScheduleInterleaved1F1B)
    order.n_local_stages, order.pp_group_size, order._n_microbatches = v, pp, m
    order.number_of_rounds = max(1, m // pp)
    order.microbatches_per_round = m // order.number_of_rounds
    peaks = []
    for rank in range(pp):
        held = peak = 0
        for action in order._calculate_single_rank_operations(rank):
            if action is None:
                continue
            if action.computation_type == _ComputationType.FORWARD:
                held += 1
            elif action.computation_type in (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT):
                held -= 1
            peak = max(peak, held)
        peaks.append(peak / v)
    return peaks


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 8, 2), (4, 4, 1)])
def test_interleaved_peaks_are_torchs_own(pp, m, v):
    assert schedule_costs("Interleaved1F1B", pp, m, v).in_flight == _torch_interleaved_peaks(pp, m, v)


def test_1f1b_holds_fewer_micro_batches_than_gpipe_and_the_bubble_shrinks_with_more():
    one_f, gpipe = schedule_costs("1F1B", 4, 16), schedule_costs("GPipe", 4, 16)
    assert one_f.in_flight == [4, 3, 2, 1] and gpipe.in_flight == [16] * 4
    assert one_f.bubble == pytest.approx(3 / 19)
    assert schedule_costs("Interleaved1F1B", 4, 16, 2).bubble == pytest.approx(3 / 35)
    with pytest.raises(ConfigError, match="the planner knows the pipeline schedules"):
        schedule_costs("ZBVZeroBubble", 4, 16, 2)


def test_stages_run_one_after_another_give_the_plain_models_loss_and_its_names():
    import copy

    from rayllm.parallel.pp import keep_stage

    args = ModelArgs(dim=64, n_layers=5, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=32)
    torch.manual_seed(0)
    model = Llama(args, seed=3)
    tokens, targets = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    parts = split_stages(args, 3, seq_len=32)
    stages = [keep_stage(copy.deepcopy(model), part) for part in parts]
    h = tokens
    for stage in stages[:-1]:
        h = stage(h)  # (B, T, dim) between stages
        assert h.shape == (2, 32, 64)
    assert torch.equal(stages[-1](h, targets), model(tokens, targets))
    names = [set(stage.state_dict()) for stage in stages]
    assert set().union(*names) == set(model.state_dict()) and sum(map(len, names)) == len(model.state_dict())
