"""`rayllm plan`: the memory planner's terms against hand arithmetic, and GPU fits (the CPU peak measured:
tests/integration/test_plan_measured.py)."""

from __future__ import annotations

import os
import re

import pytest

from rayllm.cli import main
from rayllm.config import TrainConfig
from rayllm.parallel.layout import CHECKPOINT_MODES, Layout, resolve_layout
from rayllm.parallel.plan_choice import candidate_layouts, recommend
from rayllm.parallel.planner import EAGER_SPEED, EXPOSED_FSDP_SHARE, RECOMMEND_HEADROOM, plan_memory

LLAMA_8B_PARAMS = 8_030_261_248  # Meta's published count for Llama 3.1 8B
LLAMA_70B_SHAPE = [
    "model.dim=8192",
    "model.n_layers=80",
    "model.n_heads=64",
    "model.n_kv_heads=8",
    "model.ffn_hidden=28672",
    "model.vocab_size=128256",
]


def llama_params(d: int, layers: int, q: int, kv: int, hidden: int, vocab: int) -> tuple[int, int, int]:
    """(per block, root, total) counted by hand: wq wo, wk wv, w1 w2 w3, two norms; embedding, head, norm."""
    block = 2 * d * q + 2 * d * kv + 3 * d * hidden + 2 * d
    root = 2 * vocab * d + d
    return block, root, layers * block + root


def _rows(out: str) -> dict[str, list[int]]:
    """The table's rows: term -> every whole number of bytes on its line (the total first)."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s+(\w+)\s+[\d.]+\s+([\d,]+)(.*)", line)
        if m:
            rows[m.group(1)] = [int(m.group(2).replace(",", ""))] + [
                int(x.replace(",", "")) for x in re.findall(r"\d{1,3}(?:,\d{3})+", m.group(3))
            ]
    return rows


def test_plan_llama_8b_on_4_nodes_of_8_h100(capsys):
    block, root, params = llama_params(4096, 32, 4096, 1024, 14336, 128256)
    assert params == LLAMA_8B_PARAMS
    rc = main(["plan", "configs/llama-8b.yaml", "--gpu", "h100-80gb", "--nodes", "4", "--gpus-per-node", "8"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0
    rows = _rows(out)
    # The config's own layout, as a run on 4 nodes of 8 GPUs resolves it: the shard degree divides the state.
    config = TrainConfig.from_yaml("configs/llama-8b.yaml")
    layout = resolve_layout(config.parallel, 32, ranks_per_node=8, n_params=params, use_gpu=True)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp) == (4, 4, 2)
    shard = layout.dp_shard * layout.tp  # what the state is split over
    assert "HSDP 4x4 x TP 2 (dp_replicate 4 x dp_shard 4 x tp 2)" in out.split("recommended:")[0]
    # fp32 master weights, fp32 gradients and AdamW's two fp32 states: 16 bytes a parameter, over 8.
    assert LLAMA_8B_PARAMS % shard == 0
    assert rows["parameters"][1] == 4 * LLAMA_8B_PARAMS // shard  # 4,015,130,624
    assert rows["gradients"][1] == 4 * LLAMA_8B_PARAMS // shard
    assert rows["optimizer"][0] == 8 * LLAMA_8B_PARAMS // shard
    # On top of the shards, each split two ways by TP: bf16 copies of 2 blocks in flight plus the
    # final norm and head (their own FSDP unit, gathered from their forward to their backward; the
    # embedding's unit reshards after its forward); one block's and the head's bf16 gradients and
    # their fp32 reduce-scatter inputs.
    head = 128256 * 4096 + 4096
    assert root == 2 * head - 4096
    assert rows["parameters"][0] == 4 * LLAMA_8B_PARAMS // shard + 2 * (2 * block + head) // 2
    assert rows["gradients"][0] == 4 * LLAMA_8B_PARAMS // shard + 6 * (block + head) // 2
    total = rows["total"][0]
    assert sum(v[0] for k, v in rows.items() if k != "total") == total
    assert total < 81559 * 2**20
    assert ": fits" in out.split("recommended:")[0]
    # The preset is what the planner recommends: the shortest estimated step that fits.
    recommended = out.split("recommended:")[1]
    assert "HSDP 4x4 x TP 2 (dp_replicate 4 x dp_shard 4 x tp 2)" in recommended, recommended
    assert "activation checkpointing off" in recommended and ": fits" in recommended


def test_recommend_takes_the_shortest_estimated_step_and_the_presets_are_what_it_takes():
    """Each preset's own layout is the recommendation for the hardware it is planned for, and no
    candidate that fits is estimated faster (within the 1% the estimate is not finer than)."""
    for preset, nodes in (
        ("configs/llama-8b.yaml", 4),
        ("configs/llama-70b.yaml", 8),
        ("configs/llama-405b.yaml", 16),
        ("configs/llama-8b-128k.yaml", 4),
    ):
        config = TrainConfig.from_yaml(preset)
        best = recommend(config, gpu="h100-80gb", nodes=nodes, gpus_per_node=8)
        own = plan_memory(config, gpu="h100-80gb", nodes=nodes, gpus_per_node=8)
        assert (best.layout, best.micro_batch, best.activation_checkpointing) == (
            own.layout,
            own.micro_batch,
            own.activation_checkpointing,
        ), (preset, best.summary(), own.summary())
        for layout in candidate_layouts(config, nodes, 8):
            for ac in CHECKPOINT_MODES:
                other = plan_memory(
                    config, gpu="h100-80gb", nodes=nodes, gpus_per_node=8, layout=layout, activation_checkpointing=ac
                )
                if other.total_bytes <= RECOMMEND_HEADROOM * other.gpu.memory_bytes:
                    assert best.step_seconds <= other.step_seconds * 1.01, (other.summary(), other.step_seconds)
    # The 70B preset's earlier layouts, all with full checkpointing, are estimated slower: TP 2 x
    # FSDP 32 with micro-batches of 2, FSDP over all 64 GPUs, TP 8 x FSDP 8 (64 accumulation steps).
    full = {"gpu": "h100-80gb", "nodes": 8, "gpus_per_node": 8, "activation_checkpointing": "full"}
    tp2, fsdp, tp8 = (plan_memory(_llama_70b(tp, micro), **full) for tp, micro in ((2, 2), (1, 1), (8, 1)))
    preset = plan_memory(TrainConfig.from_yaml("configs/llama-70b.yaml"), gpu="h100-80gb", nodes=8, gpus_per_node=8)
    assert preset.step_seconds < tp2.step_seconds < fsdp.step_seconds < tp8.step_seconds
    assert (preset.layout.tp, preset.accum, preset.activation_checkpointing) == (8, 64, "selective")
    assert tp8.accum == 64 and fsdp.accum == 8 and tp2.accum == 8


def test_the_step_estimate_hides_fsdp_behind_compute_but_not_tp():
    plan = plan_memory(_llama_70b(1), gpu="h100-80gb", nodes=8, gpus_per_node=8, activation_checkpointing="full")
    t = plan.seconds
    assert t["fsdp"] < t["compute"] and t["tp"] == 0  # hidden but for EXPOSED_FSDP_SHARE of it
    assert plan.step_seconds == pytest.approx(t["compute"] + EXPOSED_FSDP_SHARE * t["fsdp"])
    tp8 = plan_memory(_llama_70b(8), gpu="h100-80gb", nodes=8, gpus_per_node=8).seconds
    assert tp8["mfu"] == pytest.approx(0.4)  # train.compile "auto" compiles under TP too
    eager = _llama_70b(8)
    eager.train.compile = False
    assert plan_memory(eager, gpu="h100-80gb", nodes=8, gpus_per_node=8).seconds["mfu"] == pytest.approx(
        0.4 * EAGER_SPEED
    )


def _llama_70b(tp: int, micro: int = 1) -> TrainConfig:
    """The 70B preset with ``tp`` and a micro-batch of ``micro`` (the earlier presets' 1)."""
    layout = [f"parallel.tp={tp}", f"train.micro_batch_size={micro}"]
    if os.path.exists("configs/llama-70b.yaml"):
        return TrainConfig.from_yaml("configs/llama-70b.yaml", layout)
    return TrainConfig.from_yaml("configs/llama-8b.yaml", [*LLAMA_70B_SHAPE, *layout])


def test_plan_llama_70b_needs_tensor_parallelism():
    config = _llama_70b(8)
    plan = plan_memory(config, gpu="h100-80gb", nodes=8, gpus_per_node=8)
    print(plan.format())
    assert plan.layout.tp == 8 and plan.layout.dp == 8  # TP 8 inside a node, FSDP/HSDP across nodes
    assert plan.fits
    _, _, params = llama_params(8192, 80, 8192, 1024, 28672, 128256)
    assert plan.params == params
    assert plan.breakdown["optimizer"] == 8 * -(-params // 64)
    alone = plan_memory(_llama_70b(1), gpu="h100-80gb", nodes=1, gpus_per_node=8, layout=Layout(1, 8, 1))
    print(alone.format())
    assert not alone.fits  # 16 bytes x 70.6B / 8 GPUs = 141 GB of state alone
    assert alone.breakdown["optimizer"] + alone.breakdown["parameters"] > 81559 * 2**20


def test_plan_unknown_gpu_is_a_one_line_error(capsys):
    assert main(["plan", "configs/llama-8b.yaml", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rayllm: error: unknown GPU 'h100'; choose one of: h100-80gb, h100-80gb-tcpx, h200, a100-80gb, l40s"


def _llama_405b(*overrides: str) -> TrainConfig:
    return TrainConfig.from_yaml("configs/llama-405b.yaml", overrides=list(overrides))


def test_a_pipeline_rank_holds_its_stages_gathered_and_the_schedules_in_flight_activations():
    """PP 8 x FSDP 8 x TP 8 (torchtitan's 405B layout on 512 GPUs), 1F1B: each term of the busiest
    rank by hand from its stages (torch's stage keeps them gathered, and their fp32 gradients
    unsharded, for the whole step) and 1F1B's warm-up (stage s holds pp - s micro-batches)."""
    from rayllm.parallel.planner_pp import pipeline_ranks

    config = _llama_405b(
        "cluster.num_workers=512", "parallel.pp=8", "parallel.pp_schedule=1F1B", "parallel.tp=8", "parallel.dp_shard=8"
    )
    layout = Layout(1, 8, 8, pp=8)
    ranks = pipeline_ranks(config, layout, 1, 64, "1F1B")
    assert sum(r.params for r in ranks) == 405_853_388_800  # every parameter in exactly one stage
    assert [r.in_flight for r in ranks] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert sum(r.layers for r in ranks) == 126 and ranks[-1].layers < max(r.layers for r in ranks)  # the head weighs
    plan = plan_memory(config, gpu="h100-80gb", nodes=64, gpus_per_node=8, activation_checkpointing="full")
    r, tokens, block = plan.pipeline.rank, 8192, 3_187_703_808
    shard = 4 * -(-r.params // 64)
    assert plan.parts == {
        "param_shard": shard,
        "gathered": int(r.params / 8 * 2),
        "grad_shard": shard,
        "grad_unsharded": int((r.params * 4 + block * 2) / 8),
    }
    assert plan.breakdown["optimizer"] == 2 * shard
    # Full checkpointing: each held micro-batch keeps every block's input (on the sequence shard),
    # and one block is recomputed at a time.
    held = r.in_flight * r.layers * 2 * 16384 * tokens / 8
    assert plan.breakdown["activations"] == int(held + plan.activations_by_mode["off"] / (r.in_flight * r.layers))
    assert plan.accum == 64 and abs(plan.pipeline.bubble - 7 / 71) < 1e-12
    assert plan.comm_bytes_per_step["pp_send"] == 2 * 64 * tokens * 16384 * 2 // 8


def test_the_planner_weighs_pipelines_against_fsdp_and_names_what_does_not_fit():
    """On 16 nodes no pipeline of Llama 405B fits an H100 (the stages' gathered parameters and
    unsharded gradients on top of 50 GB of sharded state): FSDP x TP is recommended. On 64 nodes of
    GCP's a3 (a quarter of p5's network per GPU) a pipeline's sends cost less than FSDP's gathers
    across nodes, and PP is recommended."""
    from rayllm.parallel.plan_choice import recommend

    for pp in (2, 4, 8, 16):
        for micro in (1, 2):
            config = _llama_405b("cluster.num_workers=128", f"parallel.pp={pp}", "parallel.pp_schedule=1F1B")
            plan = plan_memory(config, gpu="h100-80gb", nodes=16, gpus_per_node=8, micro_batch=micro)
            assert not plan.fits, plan.summary()
    assert recommend(_llama_405b(), gpu="h100-80gb", nodes=16, gpus_per_node=8).layout.pp == 1
    tcpx = recommend(_llama_405b(), gpu="h100-80gb-tcpx", nodes=64, gpus_per_node=8)
    assert tcpx.layout.pp > 1 and tcpx.fits, tcpx.summary()


def test_context_parallelism_splits_every_sequences_activations_and_adds_the_rings_traffic():
    """Llama 3.1 8B at 131,072 tokens on 4 nodes, CP 8 in each: a GPU holds 16,384 positions of
    each sequence (its logits and activations are those tokens'), FSDP shards over dp_shard x cp,
    and the ring moves each block's keys and values to the 7 others three times a micro-batch,
    four with full checkpointing; by hand."""
    config = TrainConfig.from_yaml("configs/llama-8b-128k.yaml")
    plan = plan_memory(config, gpu="h100-80gb", nodes=4, gpus_per_node=8)
    assert plan.layout == Layout(4, 1, 1, cp=8) and plan.accum == 8
    tokens = 131_072 // 8
    assert plan.comm_bytes_per_step["cp_ring"] == 8 * 32 * 7 * tokens * 2 * 1024 * 2 * 4
    assert plan.breakdown["logits_loss"] == int(tokens * (128_256 * 12 + (4 * 4096 + 4 + 2 * 4096) + 2 * 4096))
    assert plan.parts["param_shard"] == 4 * -(-8_030_261_248 // 8)  # over dp_shard 1 x cp 8
    no_cp = plan_memory(config, gpu="h100-80gb", nodes=4, gpus_per_node=8, layout=Layout(4, 8, 1))
    assert no_cp.breakdown["logits_loss"] > 8 * plan.breakdown["logits_loss"] * 0.99 and not no_cp.fits


def test_a_pipeline_under_context_parallelism_counts_each_ranks_part_and_its_own_blocks_ring():
    """PP 2 x CP 8 of the 8B at 128k on 4 nodes (two nodes a stage, HSDP 2x1 inside it): a rank holds
    16,384 positions of each micro-batch, its stage's state is sharded over dp_shard x cp, the
    stages send those positions' hidden states, and its ring carries only its own blocks' keys and
    values; by hand from the busiest pipeline rank."""
    config = TrainConfig.from_yaml(
        "configs/llama-8b-128k.yaml", overrides=["parallel.pp=2", "parallel.dp_replicate=2", "cluster.num_workers=32"]
    )
    layout = Layout(2, 1, 1, pp=2, cp=8)
    plan = plan_memory(config, gpu="h100-80gb", nodes=4, gpus_per_node=8, layout=layout)
    r, tokens, accum = plan.pipeline.rank, 131_072 // 8, 16  # 32 sequences over 2 replicas
    assert plan.accum == accum and r.layers < 32
    assert plan.parts["param_shard"] == 4 * -(-r.params // 8)  # dp_shard 1 x cp 8
    assert plan.comm_bytes_per_step["cp_ring"] == accum * r.layers * 7 * tokens * 2 * 1024 * 2 * 4
    assert plan.comm_bytes_per_step["pp_send"] == 2 * accum * tokens * 4096 * 2
    whole = plan_memory(config, gpu="h100-80gb", nodes=4, gpus_per_node=8, layout=Layout(4, 1, 1, cp=8))
    # Half the replicas run twice the micro-batches through half the blocks: the same ring per GPU.
    assert r.layers * accum == 32 * whole.accum
    assert plan.comm_bytes_per_step["cp_ring"] == whole.comm_bytes_per_step["cp_ring"]
