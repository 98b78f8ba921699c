"""``rayllm bench gpu --check``: what only a GPU can show, each item PASS or FAIL with its figure,
ready for the first minutes a GPU is lent (one H100 or H200, torch only, no Ray, under 8 minutes).

    python -m rayllm.bench.gpu_check --out check.json      # one GPU
    python -m rayllm.bench.gpu_check --tiny                # the same code on CPU (CI): figures, no verdicts

It runs ``rayllm bench gpu`` (the ~1.2B model compiled, FSDP on NCCL, MFU, memory against the
planner, every mesh's smoke steps), then three checks of its own on the same GPU: the dtype of
what reaches a block under the bf16 policy (the RoPE tables must stay fp32), the loss of bf16
training against fp32 over the first steps from the same weights, and the planner against the
allocator's peak for a slice of Llama 3.1 8B (its width, vocabulary and 8,192-token sequences,
two layers), and that slice's step with train.float8 against bf16 and with selective activation
checkpointing (the planner's count of what it keeps), and that context parallelism's ring takes
the attention kernel a bf16 grouped-query attention dispatches to here (one rank: the ring's
code on this GPU's kernel, not its traffic). On CPU the GPU-only verdicts read "n/a": the code
paths run, the numbers do not count.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from rayllm.bench import gpu
from rayllm.bench.common import bench_trainer, synthetic_rows
from rayllm.config import TrainConfig
from rayllm.errors import RayllmError
from rayllm.loop.setup import model_args
from rayllm.model import Llama
from rayllm.parallel.apply import parallelize
from rayllm.parallel.cp import enable_cpu_ring
from rayllm.parallel.layout import Layout

MFU_GOAL = 0.5  # of the published dense bf16 peak, 1B preset (Mosaic publishes 41.8% for 1B)
PLANNER_TOLERANCE = 0.15  # measured max_memory_reserved within 15% of the plan
BF16_LOSS_TOLERANCE = 0.02  # relative, per step, over the first BF16_STEPS steps from the same weights
BF16_STEPS = 3
CP_TOLERANCE = 1e-2  # one rank's ring against the plain call, bf16 outputs and gradients
SLICE_8B = ["model.dim=4096", "model.n_layers=2", "model.n_heads=32", "model.n_kv_heads=8", "model.ffn_hidden=14336"]
SLICE_8B += ["model.vocab_size=128256", "model.rope_theta=500000.0", "model.tie_embeddings=false"]
SLICE_8B += ["data.seq_len=8192", "train.micro_batch_size=1", "train.global_batch_size=2"]
NUMERICS = ["model.dim=1024", "model.n_layers=4", "model.n_heads=16", "model.n_kv_heads=4", "model.vocab_size=32000"]
NUMERICS += ["data.seq_len=1024", "train.micro_batch_size=4", "train.global_batch_size=8", "train.compile=false"]


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # "PASS", "FAIL" or "n/a" (on CPU, or when what it judges did not run)
    figure: str


def rope_dtypes(device: torch.device) -> list[str]:
    """The dtypes of (hidden state, cos, sin) reaching the first block of a bf16-policy model."""
    config = TrainConfig.from_dict({}, overrides=gpu.TINY)
    with torch.device("meta"):
        model = Llama(model_args(config))
    model = parallelize(model, dtype=torch.bfloat16, layout=Layout(), device=device)
    seen: list[str] = []
    model.layers["0"].register_forward_pre_hook(lambda _m, args: seen.extend(str(a.dtype) for a in args))
    tokens = torch.randint(0, config.model.vocab_size, (1, 33), device=device)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return [s.removeprefix("torch.") for s in seen]


def bf16_against_fp32(device: torch.device, tiny: bool) -> dict[str, list[float]]:
    """The first steps' losses in bf16 and in fp32 from the same weights and batches."""
    shape = gpu.TINY + ["train.global_batch_size=4", "train.compile=false"] if tiny else NUMERICS
    losses = {}
    for precision in ("bf16", "fp32"):
        config = TrainConfig.from_dict({}, overrides=[*shape, f"train.precision={precision}"])
        trainer = bench_trainer(config, 0, 1, device)
        rows = synthetic_rows(config, config.train.global_batch_size)
        losses[precision] = [trainer.train_step(rows)[0] for _ in range(BF16_STEPS)]
        del trainer
    return losses


class _AttentionOps(TorchDispatchMode):
    """The aten attention ops a region dispatches to."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.seen.append(str(func).removeprefix("aten."))
        return func(*args, **(kwargs or {}))


def cp_attention(device: torch.device, tiny: bool) -> dict[str, Any]:
    """A bf16 grouped-query causal attention (the 8B's heads; the tiny model's on CPU) through
    context parallelism's ring on a one-rank CP mesh, against the plain call: the kernel it
    dispatched to, whether the ring has it, and the largest difference of output and gradients."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring  # what CP routes

    if device.type == "cpu":
        enable_cpu_ring()
    heads, kv, seq, hd = (4, 2, 64, 16) if tiny else (32, 8, 4096, 128)
    q = torch.randn(1, heads, seq, hd, device=device, dtype=torch.bfloat16)  # (B, H, T, hd)
    k, v = (torch.randn(1, kv, seq, hd, device=device, dtype=torch.bfloat16) for _ in range(2))  # (B, KV, T, hd)

    def attend(*qkv: torch.Tensor) -> list[torch.Tensor]:
        qkv = [t.clone().requires_grad_() for t in qkv]
        out = F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
        return [out, *torch.autograd.grad(out.float().square().sum(), qkv)]

    plain = attend(q, k, v)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))
    positions = torch.arange(seq, device=device)  # context_parallel cuts at least one buffer
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0]), _AttentionOps() as ops:
        ringed = attend(q, k, v)
    routed = {str(op).removeprefix("aten.") for op in ring.custom_ops}
    return {
        "ops": sorted(set(ops.seen)),
        "routed": bool(ops.seen) and set(ops.seen) <= routed,
        "max_difference": max((a.float() - b.float()).abs().max().item() for a, b in zip(ringed, plain, strict=True)),
    }


def slice_config(tiny: bool, float8: bool = False, checkpointing: str = "false") -> TrainConfig:
    run = [
        "cluster.num_workers=1",
        "train.precision=auto",
        "train.compile=auto",
        f"train.activation_checkpointing={checkpointing}",
        f"train.float8={str(float8).lower()}",
    ]
    shape = gpu.TINY + ["train.global_batch_size=2"] if tiny else SLICE_8B
    return TrainConfig.from_dict({}, overrides=[*shape, *run, f"cluster.use_gpu={str(not tiny).lower()}"])


def judge(bench: dict[str, Any], own: dict[str, Any], on_gpu: bool) -> list[Verdict]:
    """Each item's verdict from the figures (a pure function: tested on CPU with made-up figures)."""
    step, gpu_only = bench.get("step", {}), (lambda ok: ("PASS" if ok else "FAIL") if on_gpu else "n/a")
    failed = step.get("error")
    verdicts = [
        Verdict(
            "compile and FSDP on NCCL",
            gpu_only(not failed and step.get("compile") and bench.get("backend") == "nccl"),
            failed or f"{step.get('layout')}, compile {step.get('compile')}, backend {bench.get('backend')}",
        ),
        Verdict(
            "flash attention kernel", gpu_only(bool(step.get("flash_attention"))), str(step.get("flash_attention"))
        ),
    ]
    dtypes = own.get("rope_dtypes", [])
    rope_ok = dtypes[:1] == ["bfloat16"] and dtypes[1:] == ["float32", "float32"]
    verdicts.append(Verdict("RoPE tables reach the blocks in fp32", "PASS" if rope_ok else "FAIL", str(dtypes)))
    slices = (("8B slice", own.get("slice_8b", {})), ("8B slice, selective", own.get("slice_8b_selective", {})))
    for name, planned in (("1B preset", step), *slices):
        ratio = planned.get("memory", {}).get("planner", {}).get("measured_over_planned")
        ok = ratio is not None and abs(ratio - 1) <= PLANNER_TOLERANCE
        figure = f"measured x{ratio:.2f} of planned" if ratio else str(planned.get("error", "no plan"))
        verdicts.append(Verdict(f"planner within {PLANNER_TOLERANCE:.0%}: {name}", gpu_only(ok), figure))
    mfu = step.get("mfu", {}).get("published")
    figure = f"{mfu:.1%} of the published dense bf16 peak (goal {MFU_GOAL:.0%})" if mfu else "no published peak"
    verdicts.append(Verdict("MFU, 1B preset", gpu_only(bool(mfu) and mfu >= MFU_GOAL), figure))
    losses = own.get("bf16_vs_fp32", {})
    gaps = [abs(b - f) / abs(f) for b, f in zip(losses.get("bf16", []), losses.get("fp32", []), strict=False)]
    ok = len(gaps) == BF16_STEPS and max(gaps) <= BF16_LOSS_TOLERANCE
    gap = f"largest relative gap {max(gaps):.2e} over {len(gaps)} steps" if gaps else "did not run"
    verdicts.append(Verdict(f"bf16 loss within {BF16_LOSS_TOLERANCE:.0%} of fp32", "PASS" if ok else "FAIL", gap))
    verdicts.append(float8_verdict(own.get("slice_8b", {}), own.get("slice_8b_float8", {}), on_gpu))
    verdicts.append(cp_verdict(own.get("cp_attention", {})))
    smoke = bench.get("mesh_smoke", {})
    bad = [name for name, m in smoke.items() if m["status"] != "ok"]
    verdicts.append(Verdict("every mesh's steps", "PASS" if smoke and not bad else "FAIL", ", ".join(bad) or "ok"))
    return verdicts


def float8_verdict(bf16: dict[str, Any], float8: dict[str, Any], on_gpu: bool) -> Verdict:
    """train.float8 on the 8B slice: it runs, and its losses stay within the bf16 tolerance of the
    bf16 slice's on the same batch; the speed ratio is reported (the slice's bf16 head and loss,
    a third of its FLOPs, bound what float8 gains there)."""
    name = f"float8 on the 8B slice, loss within {BF16_LOSS_TOLERANCE:.0%} of bf16"
    if not on_gpu:
        return Verdict(name, "n/a", "GPU only")
    if "error" in float8 or "error" in bf16:
        return Verdict(name, "FAIL", float8.get("error") or bf16.get("error"))
    gaps = [abs(a - b) / abs(b) for a, b in zip(float8["losses"], bf16["losses"], strict=False)]
    speed = float8["tokens_per_s"] / bf16["tokens_per_s"]
    ok = bool(gaps) and max(gaps) <= BF16_LOSS_TOLERANCE
    return Verdict(name, "PASS" if ok else "FAIL", f"largest gap {max(gaps):.2e}; x{speed:.2f} the bf16 tokens/s")


def cp_verdict(cp: dict[str, Any]) -> Verdict:
    """The ring took every attention op (forward and backward) and, on one rank, changed nothing
    beyond bf16's rounding."""
    name = "context parallelism's ring takes the bf16 GQA attention kernel"
    if "error" in cp or not cp:
        return Verdict(name, "FAIL", cp.get("error", "did not run"))
    ok = cp["routed"] and cp["max_difference"] <= CP_TOLERANCE
    return Verdict(
        name, "PASS" if ok else "FAIL", f"{', '.join(cp['ops'])}; largest difference {cp['max_difference']:.1e}"
    )


def run_check(tiny: bool) -> dict[str, Any]:
    """bench gpu's run, then this module's own checks on a 1-rank group of their own."""
    bench = gpu.run(tiny)
    _, world, device = gpu.init_distributed(tiny)
    own: dict[str, Any] = {}
    try:
        if world != 1:
            raise RayllmError("rayllm bench gpu --check runs on one GPU: launch it without torchrun")
        for name, measure in (
            ("rope_dtypes", lambda: rope_dtypes(device)),
            ("cp_attention", lambda: cp_attention(device, tiny)),
            ("bf16_vs_fp32", lambda: bf16_against_fp32(device, tiny)),
            ("slice_8b", lambda: gpu.bench_step(slice_config(tiny), 0, 1, device, warmup=1, steps=2)),
            ("slice_8b_float8", lambda: float8_step(tiny, device)),
            (
                "slice_8b_selective",
                lambda: gpu.bench_step(slice_config(tiny, checkpointing="selective"), 0, 1, device, 1, 2),
            ),
        ):
            try:
                own[name] = measure()
            except Exception as e:  # one item's failure is its verdict; the others still run
                own[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    verdicts = judge(bench, own, device.type == "cuda")
    return {"bench": bench, "checks": own, "verdicts": [asdict(v) for v in verdicts]}


def float8_step(tiny: bool, device: torch.device) -> dict[str, Any]:
    """The 8B slice's step with train.float8 (GPU only: the config refuses it on CPU)."""
    if tiny:
        return {"skipped": "float8 needs a GPU"}
    return gpu.bench_step(slice_config(tiny, float8=True), 0, 1, device, warmup=1, steps=2)


def format_check(result: dict[str, Any]) -> str:
    lines = [gpu.format_result(result["bench"]), "[rayllm bench gpu --check]"]
    lines += [f"  {v['status']:<4}  {v['name']}: {v['figure']}" for v in result["verdicts"]]
    return "\n".join(lines)


def launch(tiny: bool, out: str | None, nproc: int, check: bool) -> int:
    """``rayllm bench gpu [--check]``: the check on one GPU, else bench gpu's own launch."""
    if not check:
        return gpu.launch(tiny, out, nproc)
    if nproc != 1:
        print("rayllm: error: rayllm bench gpu --check runs on one GPU: leave --nproc-per-node out", file=sys.stderr)
        return 2
    return main((["--tiny"] if tiny else []) + (["--out", out] if out else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayllm.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (gloo): what CI runs")
    parser.add_argument("--out", help="write every figure and verdict to this JSON file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    result = run_check(args.tiny)
    print(format_check(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if any(v["status"] == "FAIL" for v in result["verdicts"]) else 0


if __name__ == "__main__":
    sys.exit(main())
