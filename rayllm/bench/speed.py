"""``rayllm bench speed``: rayllm's training step against a bare PyTorch loop, MFU against the
machine's measured matmul peak, tokens/s on 1 and 2 workers, and peak memory per rank with
and without activation checkpointing and CPU offload, all measured side by side in one run.

It needs torch and rayllm's own modules, never Ray, so the same command runs on a GPU
machine that has only PyTorch: ``python -m rayllm.bench.speed CONFIG [key=value ...]``.

- Step: one process builds both sides from the same seed: rayllm's ``Trainer`` (its model as
  ``parallelize`` wraps it, its optimizer, its ``train_step``) and a bare loop written as a
  PyTorch user would write it (the same Llama, batch, AdamW groups, micro-batches, clipping,
  per-block compile, and autocast where rayllm computes in bf16). They take turns, a few steps
  each, over several rounds, and the median step time of each is compared: the ratio is
  rayllm's speed over the bare loop's (1.0: no overhead).
- MFU: the model's FLOPs per token (checked against PyTorch's FlopCounterMode in the tests)
  times rayllm's tokens/s, over the matmul peak this process measures just before.
- Workers: the Trainer's step on 1 and on 2 ranks (gloo on CPU), each rank with the same
  number of threads, on synthetic batches of the config's global batch size.
- Memory: a fresh process per variant, the config's model trained a few steps on one rank:
  peak GPU memory allocated, or on CPU the peak resident memory above what the process held
  before it built the model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayllm.bench.common import (
    bench_device,
    bench_trainer,
    cpu_name,
    flash_attention_fits,
    release_models,
    sync,
    synthetic_rows,
    timed_steps,
)
from rayllm.bench.speed_args import HELP, add_arguments
from rayllm.config import TrainConfig
from rayllm.config.resolve import resolve
from rayllm.data.order import rank_slice
from rayllm.errors import RayllmError
from rayllm.hardware import (
    keep_freed_memory,
    matmul_peak_flops,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)
from rayllm.model import Llama, flops_per_token
from rayllm.parallel.apply import compute_dtype, should_compile, wrap_blocks
from rayllm.parallel.process_group import free_port, init_group

MEMORY_VARIANTS = {
    "plain": [],
    "activation checkpointing": ["train.activation_checkpointing=true"],
    "selective checkpointing": ["train.activation_checkpointing=selective"],
    "cpu offload": ["train.cpu_offload=true"],
}


# -- shared pieces -----------------------------------------------------------------------------
class BareLoop:
    """The baseline: the training step as a PyTorch user writes it, without rayllm."""

    def __init__(self, config: TrainConfig, device: torch.device):
        from rayllm.loop.setup import model_args

        t = config.train
        self.device, self.micro = device, t.micro_batch_size
        self.dtype = compute_dtype(t.precision, device)
        torch.manual_seed(t.seed)
        self.model = Llama(model_args(config)).to(device)
        if should_compile(t.compile, device):
            wrap_blocks(self.model, activation_checkpointing=False, compile=True)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            fused=True,
        )
        self.grad_clip = t.grad_clip

    def train_step(self, rows: np.ndarray) -> tuple[float, float]:
        batch = torch.from_numpy(np.ascontiguousarray(rows["tokens"])).to(self.device, dtype=torch.long)
        micro = batch.split(self.micro)
        autocast = torch.autocast(self.device.type, dtype=self.dtype) if self.dtype != torch.float32 else nullcontext()
        total = torch.zeros((), device=self.device)
        for rows_i in micro:
            with autocast:
                loss = self.model(rows_i[:, :-1], rows_i[:, 1:]) / len(micro)
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item(), float(norm)


# -- step: rayllm against the bare loop ----------------------------------------------------------
def step_comparison(config: TrainConfig, rounds: int, steps: int) -> dict[str, Any]:
    """One process, world size 1: both sides on the same device, taking turns."""
    device = bench_device(config)
    if device.type == "cpu":
        keep_freed_memory()  # the Trainer does this too; set before either side allocates
    init_group(bench_device(config), rank=0, world_size=1)
    try:
        dtype = compute_dtype(config.train.precision, device)
        peak = matmul_peak_flops(device, dtype, seconds=1.0)
        sides = {"bare": BareLoop(config, device), "rayllm": bench_trainer(config, 0, 1, device)}
        rows = synthetic_rows(config, config.train.global_batch_size)
        for side in sides.values():  # warm-up: compilation, allocator, kernels chosen
            for _ in range(2):
                side.train_step(rows)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    sides[name].train_step(rows)
                sync(device)
                times[name].append((time.perf_counter() - start) / steps)
        # Measured again after: a peak taken while something else ran would inflate MFU.
        peak = max(peak, matmul_peak_flops(device, dtype, seconds=1.0))
        trainer = sides["rayllm"]
        tokens = config.train.global_batch_size * config.data.seq_len
        fpt = flops_per_token(trainer.args, config.data.seq_len)
        median = {name: statistics.median(v) for name, v in times.items()}
        return {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
            "threads": torch.get_num_threads(),
            "dtype": str(trainer.dtype).removeprefix("torch."),
            "compile": should_compile(config.train.compile, device),
            "flash_attention": flash_attention_fits(config, device, trainer.dtype),
            "params": trainer.n_params,
            "flops_per_token": fpt,
            "tokens_per_step": tokens,
            "peak_flops": peak,
            "step_s": median,
            "step_s_all": times,
            "tokens_per_s": {name: tokens / s for name, s in median.items()},
            "ratio": median["bare"] / median["rayllm"],
            "mfu": fpt * tokens / median["rayllm"] / peak,
            "mfu_bare": fpt * tokens / median["bare"] / peak,
        }
    finally:
        dist.destroy_process_group()


# -- ranks in processes of their own: tokens/s on 1 and 2 workers, memory, losses ---------------
def _rank_main(rank: int, world_size: int, port: int, config: TrainConfig, threads: int, steps: int, out) -> None:
    if threads:
        torch.set_num_threads(threads)
    device = bench_device(config, rank)
    init_group(device, rank=rank, world_size=world_size, port=port)
    try:
        _warm_up(config, rank, world_size, device)
        before = resident_bytes()
        reset_peak_resident()
        trainer = bench_trainer(config, rank, world_size, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # The rank's data slice: TP and CP peers and a pipeline's stages share one (DataSlicing).
        rows = rank_slice(synthetic_rows(config, config.train.global_batch_size), trainer.data_rank, trainer.layout.dp)
        losses, times = timed_steps(trainer, rows, steps, device)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = peak_resident_bytes() - before
        if rank == 0:
            timed = times[2:] or times  # the first steps compile, fault in memory and pick kernels
            out.put({"losses": losses, "step_s": statistics.median(timed), "peak_bytes": peak})
    finally:
        dist.destroy_process_group()


WARM_UP_SHAPE = ["model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=4", "model.vocab_size=256"]


def _warm_up(config: TrainConfig, rank: int, world_size: int, device: torch.device) -> None:
    """One step of a tiny model through the same code path, before the memory baseline: what the
    first step loads once (lazily imported modules, a CUDA build's libraries, gloo's and DTensor's
    first-call state; 50 to 150 MB on CPU, more with a CUDA build of torch) is not the model's."""
    p = config.parallel
    per_rank = p.pp_stages_per_rank if isinstance(p.pp_stages_per_rank, int) else 2
    layers = f"model.n_layers={p.pp * per_rank if p.pp > 1 else 1}"  # a block for every pipeline stage
    tiny = config.with_overrides([*WARM_UP_SHAPE, layers, "data.seq_len=16", "train.compile=false"])
    trainer = bench_trainer(tiny, rank, world_size, device)
    rows = synthetic_rows(tiny, tiny.train.global_batch_size)
    trainer.train_step(rank_slice(rows, trainer.data_rank, trainer.layout.dp))
    del trainer
    gc.collect()


def run_ranks(config: TrainConfig, world_size: int, steps: int, threads: int = 0) -> dict[str, Any]:
    """``steps`` of the Trainer's step on ``world_size`` fresh processes (the same synthetic global
    batch every step): rank 0's losses, median step time after two warm-up steps, and peak memory
    (GPU memory allocated; on CPU resident memory above what the process held once warmed up by a
    tiny model's step, before the model)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, config, threads, steps, out))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank of the {world_size}-rank run failed (exit codes {[p.exitcode for p in procs]})")
    return out.get(timeout=30)


def tokens_per_s_by_workers(config: TrainConfig, counts: list[int], threads: int, steps: int) -> dict[int, float]:
    tokens = config.train.global_batch_size * config.data.seq_len
    return {n: tokens / run_ranks(config, n, steps + 2, threads)["step_s"] for n in counts}


def memory_by_variant(config: TrainConfig, steps: int) -> dict[str, dict[str, Any]]:
    """Each of MEMORY_VARIANTS on one rank, in a fresh process: peak memory and the losses."""
    result: dict[str, dict[str, Any]] = {}
    for name, overrides in MEMORY_VARIANTS.items():
        if name == "cpu offload" and not config.cluster.use_gpu:
            result[name] = {"skipped": "needs a GPU (FSDP offloads GPU state to CPU memory)"}
            continue
        result[name] = run_ranks(config.with_overrides(overrides), 1, steps)
    return result


# -- the whole benchmark -------------------------------------------------------------------------
def run(
    config: TrainConfig,
    *,
    rounds: int = 5,
    steps: int = 4,
    workers: list[int] | None = None,
    memory_steps: int = 3,
    on_part: Callable[[dict[str, Any]], None] = lambda _: None,
) -> dict[str, Any]:
    """The comparison in this process, then the processes of their own; ``on_part`` gets the
    result so far after each part (a GPU's time is scarce: a later part's failure keeps it)."""
    started = time.perf_counter()
    result: dict[str, Any] = {"config": config.run.name}
    result["step"] = step_comparison(config, rounds, steps)
    release_models(bench_device(config))  # the two models' memory, before the ranks' processes start
    on_part(result)
    if not config.cluster.use_gpu and workers:
        threads = max(1, (os.cpu_count() or 1) // max(workers))
        result["workers"] = {
            "threads_per_worker": threads,
            "tokens_per_s": tokens_per_s_by_workers(config, workers, threads, steps),
        }
        on_part(result)
    if memory_steps:
        result["memory"] = memory_by_variant(config, memory_steps)
    result["seconds"] = time.perf_counter() - started
    return result


def format_result(r: dict[str, Any]) -> str:
    s = r["step"]
    gf = 1e9
    lines = [
        f"[rayllm bench speed] {r['config']}: {s['params'] / 1e6:,.1f}M parameters, "
        f"{s['flops_per_token'] / 1e6:,.1f} MFLOP/token, {s['tokens_per_step']:,} tokens/step",
        f"  on {s['device']} ({s['device_name']}, {s['threads']} threads), {s['dtype']}, "
        f"compile {'on' if s['compile'] else 'off'}, SDPA flash kernel "
        f"{'fits' if s['flash_attention'] else 'does not fit'} this attention",
        f"  step (median of {len(s['step_s_all']['rayllm'])} interleaved rounds)",
        f"    bare PyTorch loop   {s['step_s']['bare'] * 1e3:9.1f} ms  {s['tokens_per_s']['bare']:>12,.0f} tokens/s",
        f"    rayllm Trainer      {s['step_s']['rayllm'] * 1e3:9.1f} ms  {s['tokens_per_s']['rayllm']:>12,.0f} tokens/s",
        f"    speed ratio rayllm / bare: {s['ratio']:.3f}  (goal >= 0.97)",
        f"  MFU: rayllm {s['mfu']:.1%}, bare loop {s['mfu_bare']:.1%} of the measured {s['dtype']} matmul peak, "
        f"{s['peak_flops'] / gf:,.0f} GFLOP/s (goal >= {'50' if s['device'].startswith('cuda') else '60'}%)",
    ]
    if "workers" in r:
        w = r["workers"]
        tps = w["tokens_per_s"]
        lines.append(f"  workers ({w['threads_per_worker']} thread(s) each)")
        for n, v in tps.items():
            lines.append(f"    {n} worker(s)   {v:>12,.0f} tokens/s")
        if 1 in tps and 2 in tps:
            lines.append(f"    scaling 2 vs 1: {tps[2] / tps[1]:.2f}x  (efficiency {tps[2] / tps[1] / 2:.0%})")
    if "memory" in r:
        mem = r["memory"]
        base = mem.get("plain", {}).get("peak_bytes")
        kind = "GPU memory allocated" if r["step"]["device"].startswith("cuda") else "resident memory above start"
        lines.append(f"  peak memory per rank ({kind})")
        for name, v in mem.items():
            if "skipped" in v:
                lines.append(f"    {name:<25} {v['skipped']}")
                continue
            ratio = f"  x{v['peak_bytes'] / base:.2f}" if base else ""
            loss = ", ".join(f"{x:.4f}" for x in v["losses"])
            lines.append(f"    {name:<25} {v['peak_bytes']:>15,} bytes{ratio}   losses {loss}")
    lines.append(f"  ({r['seconds']:.0f} s in all)")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


def report(config: TrainConfig, args: argparse.Namespace) -> None:
    """Run as the command line asks, print the figures and write them as JSON when asked."""
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    on_part = (lambda part: write_json(part, args.json)) if args.json else (lambda _: None)
    result = run(
        config, rounds=args.rounds, steps=args.steps, workers=workers, memory_steps=args.memory_steps, on_part=on_part
    )
    print(format_result(result))
    if args.json:
        write_json(result, args.json)


def main(argv: list[str] | None = None) -> int:
    """``python -m rayllm.bench.speed ...``: the same as ``rayllm bench speed ...``, for machines
    where rayllm is on the path but not installed (no console script)."""
    parser = add_arguments(argparse.ArgumentParser(prog="python -m rayllm.bench.speed", description=HELP))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report(resolve(TrainConfig.from_yaml(args.config, overrides=args.overrides)), args)
    except RayllmError as e:
        print(f"rayllm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
