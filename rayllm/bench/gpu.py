"""``rayllm bench gpu``: the one-GPU measurement, ready to run on a machine with only torch.

    torchrun --nproc_per_node=1 -m rayllm.bench.gpu --out gpu.json   # ~1.2B Llama, seq 4096, bf16, compile
    python -m rayllm.bench.gpu --tiny --out tiny.json                # the same code on CPU (gloo, fp32): CI

Full mode trains configs/llama-1b-1gpu.yaml's model (Llama 3.2 1B's shape, 1.24B parameters) on
synthetic tokens through the real ``Trainer.train_step``: warm-up steps (compilation), then timed
steps; it prints tokens/s, MFU against the GPU's published dense bf16 peak and against the matmul
peak measured in the same run, peak memory beside the memory planner's prediction, then a 2-step
smoke of every mesh the ranks can host. One rank makes every degree 1, so there each code path
is built explicitly instead (FSDP over a 1-rank mesh, a 1x1 HSDP mesh, ``apply_tp`` on a 1-rank
"tp" mesh under FSDP); with more ranks the real layouts run through the Trainer.
No Ray anywhere in the imports: the GPU machine needs torch and rayllm's own modules only.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from rayllm.bench.common import StepSession, cpu_name, flash_attention_fits, synthetic_rows, timed_steps
from rayllm.config import TrainConfig
from rayllm.data.order import rank_slice
from rayllm.errors import RayllmError
from rayllm.hardware import (
    matmul_peak_flops,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)
from rayllm.loop.optimizer import build_optimizer
from rayllm.loop.setup import model_args
from rayllm.loop.trainer import Trainer
from rayllm.model import Llama, flops_per_token
from rayllm.parallel import gpus
from rayllm.parallel.apply import compute_dtype
from rayllm.parallel.fsdp import apply_fsdp
from rayllm.parallel.gpus import published_peak_flops
from rayllm.parallel.init import materialize
from rayllm.parallel.layout import Layout
from rayllm.parallel.mesh import build_mesh, tp_mesh
from rayllm.parallel.process_group import free_port, init_group, local_device
from rayllm.parallel.tp import apply_tp

# configs/llama-1b-1gpu.yaml's model and micro-batch (tests/unit/test_bench_gpu_config.py keeps them equal).
FULL = """model.dim=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.vocab_size=128256
    model.ffn_hidden=8192 model.rope_theta=500000.0 model.tie_embeddings=true data.seq_len=4096
    train.micro_batch_size=4""".split()
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=1024"]
TINY += ["data.seq_len=64", "train.micro_batch_size=2"]
SMOKE_STEPS = 2
CONVENTION = (
    "attention 12*L*H*hd*T FLOPs per token, the full T x T square (torchtitan, PaLM); causal-halved: 6*L*H*hd*T"
)
SMOKE_PATHS = {
    "fsdp": "fully_shard on a 1-rank dp_shard mesh",
    "hsdp": "fully_shard on a 1x1 (dp_replicate, dp_shard) mesh: HSDP",
    "tp+fsdp": "apply_tp on a 1-rank tp mesh, then fully_shard on dp_shard; loss_parallel",
}


def planner_gpu(name: str | None) -> str | None:
    """The memory planner's key for a CUDA device name (None: CPU, or a GPU it has no entry for)."""
    spec = gpus.for_device(name)
    return spec.name if spec is not None else None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def bench_config(tiny: bool, world: int) -> TrainConfig:
    """8 micro-batches per step on one GPU (32 x 4,096 tokens, as the 1-GPU config), 4 in tiny mode."""
    shape, accum = (TINY, 4) if tiny else (FULL, 8)
    micro = int(shape[-1].split("=")[1])
    batch = f"train.global_batch_size={micro * world * max(1, accum // world)}"
    run = [f"cluster.use_gpu={not tiny}".lower(), f"cluster.num_workers={world}", f"run.name=bench-gpu-{world}"]
    auto = ["train.precision=auto", "train.compile=auto", "train.warmup_steps=2"]
    return TrainConfig.from_dict({}, overrides=[*shape, batch, *auto, *run])


def init_distributed(tiny: bool) -> tuple[int, int, torch.device]:
    """The CUDA device first, then the group bound to it (``device_id``): NCCL's communicators
    are made for that device and no collective lands on GPU 0 by default. Under torchrun the
    group comes from its environment; launched as plain python, a 1-rank group on 127.0.0.1."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if tiny:
        # One thread: the tiny model's matmuls gain nothing from more, and on a shared CI machine
        # spinning OpenMP threads made each step ten times slower.
        torch.set_num_threads(1)
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise RayllmError("rayllm bench gpu needs a CUDA GPU; --tiny runs the same code on CPU (gloo, fp32)")
    else:
        device = local_device(True)
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        init_group(device)
    else:
        init_group(device, rank=0, world_size=1)
    return rank, world, device


def _all_reduce(value: float, device: torch.device, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t[0])


def _planned(config: TrainConfig, gpu: str | None, world: int, layout: Layout) -> dict[str, Any]:
    """The planner's bytes per GPU for this run, or why there are none (it is written alongside)."""
    try:
        from rayllm.parallel.planner import plan_memory

        plan = plan_memory(
            config, gpu=gpu, nodes=1, gpus_per_node=world, layout=layout, micro_batch=config.train.micro_batch_size
        )
        return {"total_bytes": int(plan.total_bytes), "breakdown": {k: int(v) for k, v in plan.breakdown.items()}}
    except (ImportError, NotImplementedError, AttributeError) as e:
        return {"unavailable": f"planner not available ({type(e).__name__})"}
    except Exception as e:  # a planner error must not cost the measured figures
        return {"unavailable": f"planner failed: {e!r}"[:300]}


def bench_step(config: TrainConfig, rank: int, world: int, device: torch.device, warmup: int, steps: int):
    """The Trainer's step on synthetic tokens: tokens/s, MFU both ways, peak memory."""
    dtype = compute_dtype(config.train.precision, device)
    cuda = device.type == "cuda"
    peak = matmul_peak_flops(device, dtype, seconds=1.0)
    if cuda:
        torch.cuda.empty_cache()  # the matmuls' blocks: not the training's reserved memory
        torch.cuda.reset_peak_memory_stats(device)
    before = resident_bytes()
    reset_peak_resident()
    trainer = Trainer(config, StepSession(rank, world, device))
    rows = rank_slice(synthetic_rows(config, config.train.global_batch_size), trainer.data_rank, trainer.layout.dp)
    losses, times = timed_steps(trainer, rows, warmup + steps, device)
    if cuda:
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    else:
        allocated, reserved = int(peak_resident_bytes() - before), int(peak_resident_bytes())
    peak = max(peak, matmul_peak_flops(device, dtype, seconds=1.0))  # again after: a busy moment reads low
    timed = times[warmup:]
    args, seq = trainer.args, config.data.seq_len
    tokens = config.train.global_batch_size * seq
    tokens_per_s = tokens * len(timed) / sum(timed)
    # Causal attention: flops_per_token counts the score and value matmuls over the full T x T
    # square, 12 * layers * heads * head_dim * T per token for forward + backward, as torchtitan's
    # get_num_flop_per_token and PaLM's appendix B do (MFU's usual convention, and what SDPA's
    # kernels compute without block skipping). Flash attention skips the masked half: the
    # causal-halved figure counts 6 * layers * heads * head_dim * T instead.
    fpt = flops_per_token(args, seq)
    attention = 12.0 * args.n_layers * args.n_heads * args.head_dim * seq
    fpt_causal = fpt - attention / 2
    name = device_name(device)
    published = published_peak_flops(name, torch.bfloat16) if cuda else None
    measured = _all_reduce(peak, device)  # every rank's peak: MFU over all the ranks' FLOP/s
    mfu = {"measured": fpt * tokens_per_s / measured, "measured_causal": fpt_causal * tokens_per_s / measured}
    if published:
        mfu |= {"published": fpt * tokens_per_s / published / world}
        mfu |= {"published_causal": fpt_causal * tokens_per_s / published / world}
    t, gpu = config.train, planner_gpu(name) if cuda else None
    result = dict(layout=trainer.layout.describe(), dtype=str(trainer.dtype).removeprefix("torch."))
    result |= dict(compile=trainer.compile.compile, params=trainer.n_params)  # after the probe: what ran
    result |= dict(flash_attention=flash_attention_fits(config, device, trainer.dtype))
    result["model"] = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")}
    result |= dict(seq_len=seq, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size)
    result |= dict(tokens_per_step=tokens, warmup_steps=warmup, first_step_s=times[0], step_s=timed)
    result |= dict(step_s_median=statistics.median(timed), tokens_per_s=tokens_per_s, losses=losses)
    result["flops_per_token"] = dict(full_square=fpt, causal_halved=fpt_causal, attention_full_square=attention)
    result |= dict(attention_convention=CONVENTION, mfu=mfu)
    result["peak_flops"] = dict(published_bf16_per_gpu=published, measured_per_rank=peak, measured_all_ranks=measured)
    kind = "torch.cuda max_memory_allocated / reserved" if cuda else "CPU resident: above start / total peak"
    plan = _planned(config, gpu, world, trainer.layout)
    if "total_bytes" in plan:  # like for like: the CUDA context is outside the allocator's counts
        framework = plan["breakdown"].get("framework_reserve", 0) if cuda else 0
        plan["compared"] = "total - framework_reserve vs max_memory_reserved" if cuda else "total vs peak resident"
        plan["measured_over_planned"] = reserved / max(1, plan["total_bytes"] - framework)
    result["memory"] = dict(kind=kind, peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, planner_gpu=gpu)
    result["memory"]["planner"] = plan
    del trainer
    return result


def _smoke_one_rank(config: TrainConfig, kind: str, device: torch.device) -> tuple[list[float], str]:
    """Each code path on a 1-rank mesh (parallelize skips them all when every degree is 1)."""
    tp = kind.startswith("tp")
    if tp:  # TP splits the embedding and the head two ways: they cannot share one weight
        config = config.with_overrides(["model.tie_embeddings=false"])
    dtype = compute_dtype(config.train.precision, device)
    with torch.device("meta"):
        model = Llama(model_args(config))
    mesh = build_mesh(Layout(), device.type)  # (dp_replicate, dp_shard, tp) = (1, 1, 1)
    if tp:
        apply_tp(model, tp_mesh(mesh))
    fsdp_mesh = mesh["dp_replicate", "dp_shard"] if kind == "hsdp" else mesh["dp_shard"]
    apply_fsdp(model, fsdp_mesh, dtype=dtype, cpu_offload=False)
    materialize(model, device, config.train.seed)
    # The product's own step on this model: the Trainer as one rank builds it, then the model and
    # its optimizer swapped for the ones with every code path applied (its loss follows the model).
    trainer = Trainer(config, StepSession(0, 1, device))
    trainer.model, trainer.optimizer = model, build_optimizer(model, config, device)
    rows = synthetic_rows(config, config.train.global_batch_size)
    return [trainer.train_step(rows)[0] for _ in range(SMOKE_STEPS)], SMOKE_PATHS[kind]


def _smoke_layout(config: TrainConfig, rank: int, world: int, device: torch.device) -> tuple[list[float], str]:
    trainer = Trainer(config, StepSession(rank, world, device))
    rows = rank_slice(synthetic_rows(config, config.train.global_batch_size), trainer.data_rank, trainer.layout.dp)
    return [trainer.train_step(rows)[0] for _ in range(SMOKE_STEPS)], trainer.layout.describe()


def real_layouts(world: int) -> dict[str, tuple[int, int, int]]:
    """(dp_replicate, dp_shard, tp) of each layout ``world`` ranks can host, by name."""
    layouts = {f"fsdp{world}": (1, world, 1)}
    if world % 2 == 0:
        layouts["tp2" if world == 2 else f"tp2xfsdp{world // 2}"] = (1, world // 2, 2)
        layouts[f"hsdp2x{world // 2}"] = (2, world // 2, 1)
    return layouts


def smoke_meshes(config: TrainConfig, rank: int, world: int, device: torch.device) -> dict[str, dict[str, Any]]:
    """Two steps of each mesh on a short sequence, one micro-batch per data-parallel rank, eager."""
    seq = min(config.data.seq_len, 1024)
    micro = config.train.micro_batch_size
    base = [f"data.seq_len={seq}", "train.compile=false"]
    if world == 1:
        runs = {k: (base + [f"train.global_batch_size={micro}"], k) for k in SMOKE_PATHS}
    else:
        runs = {}
        for name, (rep, shard, tp) in real_layouts(world).items():
            degrees = [f"parallel.dp_replicate={rep}", f"parallel.dp_shard={shard}", f"parallel.tp={tp}"]
            untie = ["model.tie_embeddings=false"] if tp > 1 else []
            runs[name] = ([*base, *degrees, *untie, f"train.global_batch_size={micro * rep * shard}"], None)
    results: dict[str, dict[str, Any]] = {}
    for name, (overrides, kind) in runs.items():
        started = time.perf_counter()
        losses: list[float] = []
        try:
            cfg = config.with_overrides(overrides)
            losses, what = _smoke_one_rank(cfg, kind, device) if kind else _smoke_layout(cfg, rank, world, device)
            error = None if all(math.isfinite(x) for x in losses) else "non-finite loss"
        except Exception as e:  # recorded, and the other meshes still run
            what, error = name, f"{type(e).__name__}: {e}"[:500]
        ok = _all_reduce(float(error is None), device, dist.ReduceOp.MIN) == 1.0
        status = "ok" if ok else f"failed: {error or 'on another rank'}"
        results[name] = {"status": status, "what": what, "losses": losses, "seconds": time.perf_counter() - started}
        gc.collect()
    return results


def _si(x: float, unit: str) -> str:
    """``x`` with an SI prefix, 3 significant digits: 9.05 GFLOP, 412 GFLOP/s."""
    prefix, scale = next(
        ((p, v) for p, v in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if x >= v), ("", 1)
    )
    return f"{x / scale:.3g} {prefix}{unit}"


def format_result(r: dict[str, Any]) -> str:
    s = r["step"]
    head = f"[rayllm bench gpu] {r['mode']} mode on {r['device']} ({r['device_name']}), {r['backend']}, "
    head += f"{r['world_size']} rank(s)"
    if "error" in s:
        lines = [head, f"  training step FAILED: {s['error']}"]
    else:
        mem, pf, fpt, plan = s["memory"], s["peak_flops"], s["flops_per_token"], s["memory"]["planner"]
        lines = [
            head + f" ({s['layout']}): {s['params'] / 1e6:,.1f}M parameters, seq {s['seq_len']:,}, "
            f"{s['tokens_per_step']:,} tokens/step, {s['dtype']}, compile {'on' if s['compile'] else 'off'}",
            f"  step {s['step_s_median'] * 1e3:10.1f} ms (median of {len(s['step_s'])} after {s['warmup_steps']} "
            f"warm-up, the first {s['first_step_s']:.2f} s)  {s['tokens_per_s']:>12,.0f} tokens/s  "
            f"loss {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}",
            f"  per token {_si(fpt['full_square'], 'FLOP')}: 6 x matmul weights + attention "
            f"{_si(fpt['attention_full_square'], 'FLOP')} = 12*L*H*hd*T over the full T x T square, causal mask not "
            f"halved (torchtitan, PaLM); causal-halved {_si(fpt['causal_halved'], 'FLOP')}",
            f"  MFU per rank against {'':>23} {'attention full square':>22}  {'causal-halved':>14}",
        ]
        published = pf["published_bf16_per_gpu"]
        peaks = [("published dense bf16", published, "published")] if published else []
        for label, flops, key in [*peaks, (f"measured {s['dtype']} matmul", pf["measured_per_rank"], "measured")]:
            mfu, causal = s["mfu"][key], s["mfu"][key + "_causal"]
            lines.append(f"    {label:<24} {_si(flops, 'FLOP/s'):>16} {mfu:>22.1%}  {causal:>14.1%}")
        if not published:
            lines.append("    (no published peak for this device in rayllm.parallel.gpus)")
        lines.append(
            f"  peak memory ({mem['kind']}): {_si(mem['peak_allocated_bytes'], 'B')} / "
            f"{_si(mem['peak_reserved_bytes'], 'B')}"
        )
        key = mem["planner_gpu"] or "no GPU entry"
        if "unavailable" in plan:
            lines.append(f"  planner ({key}): {plan['unavailable']}")
        else:
            lines.append(
                f"  planner ({key}): {_si(plan['total_bytes'], 'B')}; {plan['compared']}: "
                f"measured x{plan['measured_over_planned']:.2f} of planned"
            )
    lines.append(f"  mesh smoke ({SMOKE_STEPS} steps each, over {r['backend']})")
    for name, m in r["mesh_smoke"].items():
        loss = ", ".join(f"{x:.3f}" for x in m["losses"])
        lines.append(f"    {name:<10} {m['status']:<4} {m['what']}: losses {loss} ({m['seconds']:.1f} s)")
    return "\n".join([*lines, f"  ({r['seconds']:.0f} s in all)"])


def run(tiny: bool, warmup: int | None = None, steps: int | None = None) -> dict[str, Any] | None:
    """The whole benchmark on the process group of this launch; the result on rank 0, else None."""
    started = time.perf_counter()
    rank, world, device = init_distributed(tiny)
    try:
        config = bench_config(tiny, world)
        warmup = (1 if tiny else 3) if warmup is None else warmup
        steps = (3 if tiny else 10) if steps is None else steps
        result = dict(mode="tiny" if tiny else "full", backend=dist.get_backend(), world_size=world)
        result |= dict(device=str(device), device_name=device_name(device))
        try:
            result["step"] = bench_step(config, rank, world, device, warmup, steps)
        except Exception as e:  # reported, and the meshes are still tried: a GPU run's time is scarce
            result["step"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        gc.collect()
        if device.type == "cuda":
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        result["mesh_smoke"] = smoke_meshes(config, rank, world, device)
        result["seconds"] = time.perf_counter() - started
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayllm.bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (gloo, fp32): what CI runs")
    parser.add_argument("--out", help="write every figure to this JSON file")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3; tiny 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default 10; tiny 3)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(args.tiny, args.warmup, args.steps)
    except RayllmError as e:
        print(f"rayllm: error: {e}", file=sys.stderr)
        return 2
    if result is None:
        return 0
    print(format_result(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    losses_ok = all(math.isfinite(x) for x in result["step"].get("losses", [math.nan]))
    return 0 if losses_ok and all(m["status"] == "ok" for m in result["mesh_smoke"].values()) else 1


def launch(tiny: bool, out: str | None, nproc: int) -> int:
    """``rayllm bench gpu``: in this process for one rank, else under torchrun."""
    argv = (["--tiny"] if tiny else []) + (["--out", out] if out else [])
    if nproc == 1:
        return main(argv)
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1"]
    torchrun += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "rayllm.bench.gpu", *argv]
    return subprocess.run(torchrun).returncode


if __name__ == "__main__":
    sys.exit(main())
