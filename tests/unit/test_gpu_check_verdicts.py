"""The prepared GPU check's verdicts from its figures (rayllm.bench.gpu_check.judge): a GPU run that
meets each goal passes, one that misses it fails by name, and on CPU the GPU-only items read n/a."""

from __future__ import annotations

import copy

from rayllm.bench.gpu_check import judge

BENCH = {
    "backend": "nccl",
    "step": {
        "compile": True,
        "layout": "1 rank",
        "flash_attention": True,
        "mfu": {"published": 0.52},
        "memory": {"planner": {"measured_over_planned": 0.93}},
    },
    "mesh_smoke": {"fsdp": {"status": "ok"}, "hsdp": {"status": "ok"}},
}
OWN = {
    "rope_dtypes": ["bfloat16", "float32", "float32"],
    "bf16_vs_fp32": {"bf16": [10.4, 9.9, 9.5], "fp32": [10.39, 9.91, 9.49]},
    "slice_8b": {"memory": {"planner": {"measured_over_planned": 1.08}}, "losses": [11.9, 11.8], "tokens_per_s": 9e4},
    "slice_8b_float8": {"losses": [11.95, 11.82], "tokens_per_s": 1.1e5},
    "slice_8b_selective": {"memory": {"planner": {"measured_over_planned": 0.95}}},
    "cp_attention": {
        "ops": ["_scaled_dot_product_flash_attention.default", "_scaled_dot_product_flash_attention_backward.default"],
        "routed": True,
        "max_difference": 0.0,
    },
}
CP = "context parallelism's ring takes the bf16 GQA attention kernel"
FLOAT8 = "float8 on the 8B slice, loss within 2% of bf16"


def statuses(bench=BENCH, own=OWN, on_gpu=True) -> dict[str, str]:
    return {v.name: v.status for v in judge(bench, own, on_gpu)}


def test_a_gpu_run_that_meets_every_goal_passes_every_item():
    assert set(statuses().values()) == {"PASS"}, statuses()


def test_each_miss_fails_its_own_item():
    bench, own = copy.deepcopy(BENCH), copy.deepcopy(OWN)
    bench["step"]["mfu"]["published"] = 0.41
    own["rope_dtypes"] = ["bfloat16", "bfloat16", "bfloat16"]  # the defect issue 29 found
    own["slice_8b"]["memory"]["planner"]["measured_over_planned"] = 1.3
    own["bf16_vs_fp32"]["bf16"][2] = 12.0
    own["slice_8b_float8"]["losses"][1] = 12.5
    own["slice_8b_selective"]["memory"]["planner"]["measured_over_planned"] = 0.7
    own["cp_attention"]["routed"] = False  # e.g. fp32 GQA falls to the math kernel, which the ring lacks
    failed = sorted(k for k, v in statuses(bench, own).items() if v == "FAIL")
    assert failed == [
        "MFU, 1B preset",
        "RoPE tables reach the blocks in fp32",
        "bf16 loss within 2% of fp32",
        CP,
        FLOAT8,
        "planner within 15%: 8B slice",
        "planner within 15%: 8B slice, selective",
    ]


def test_a_failed_step_and_a_failed_mesh_are_named():
    bench = copy.deepcopy(BENCH)
    bench["step"] = {"error": "OutOfMemoryError: CUDA out of memory"}
    bench["mesh_smoke"]["hsdp"]["status"] = "failed: boom"
    verdicts = {v.name: v for v in judge(bench, OWN, True)}
    assert verdicts["compile and FSDP on NCCL"].figure == "OutOfMemoryError: CUDA out of memory"
    assert verdicts["every mesh's steps"].status == "FAIL" and verdicts["every mesh's steps"].figure == "hsdp"
    assert verdicts[FLOAT8].figure == "largest gap 4.20e-03; x1.22 the bf16 tokens/s"
    own = copy.deepcopy(OWN)
    own["slice_8b_float8"] = {"error": "ConfigError: train.float8 needs float8 matmuls"}
    own["cp_attention"] = {"error": "NotImplementedError: aten._scaled_dot_product_cudnn_attention"}
    verdicts = {v.name: v for v in judge(BENCH, own, True)}
    assert verdicts[FLOAT8].figure == own["slice_8b_float8"]["error"]
    assert (verdicts[CP].status, verdicts[CP].figure) == ("FAIL", own["cp_attention"]["error"])
    own["cp_attention"] = {**OWN["cp_attention"], "max_difference": 0.5}  # the ring changed the result
    assert {v.name: v for v in judge(BENCH, own, True)}[CP].status == "FAIL"


def test_on_cpu_the_gpu_only_items_read_na():
    cpu = statuses(on_gpu=False)
    assert cpu["compile and FSDP on NCCL"] == cpu["MFU, 1B preset"] == cpu["flash attention kernel"] == "n/a"
    assert cpu["RoPE tables reach the blocks in fp32"] == "PASS"
    assert cpu[FLOAT8] == "n/a"
