"""``rayllm bench checkpoint``: how long the step loop stalls on an async checkpoint against a
synchronous one, measured side by side in one run.

The same training runs three times under plain torch.distributed (torchrun, no Ray, so this
also runs on a GPU machine that has only torch): checkpoints only at the end, synchronous
checkpoints every few steps, and async ones (``train.async_checkpoint``). Two figures per
checkpoint:

- loop stall: the time the step loop itself spent on the checkpoint, as the trainer measures
  it (an async save: handing the shards to DCP, waiting for their copy to CPU memory before
  the next optimizer step, committing; a synchronous save: all of the write);
- wall overhead: the run's extra wall time over the run without checkpoints, divided by the
  number of checkpoints. This also counts what the background writer takes from training
  (cores, memory bandwidth), so it is the honest figure on a small machine.

The model is larger than the tiny config's by default (about 30M parameters, 350 MB of model
and optimizer state per checkpoint) so that a save takes long enough to measure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from rayllm.errors import RayllmError

BENCH_OVERRIDES = [
    "model.dim=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "data.seq_len=128",
    "data.val=null",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.val_every=1000000",
    "train.keep_checkpoints=2",
    "tracking.enabled=false",
]


@dataclasses.dataclass
class Variant:
    name: str
    checkpoints: int
    loop_stall_s: list[float]  # per checkpoint between start and end
    train_s: float  # first completed step -> last step

    @property
    def median_stall_s(self) -> float:
        return statistics.median(self.loop_stall_s) if self.loop_stall_s else 0.0


@dataclasses.dataclass
class Result:
    workers: int
    steps: int
    every: int
    repeats: int
    params: int
    state_bytes: int
    variants: dict[str, Variant]

    def overhead_s(self, name: str) -> float:
        v, base = self.variants[name], self.variants["none"]
        return (v.train_s - base.train_s) / max(1, v.checkpoints)

    @property
    def stall_ratio(self) -> float:
        sync = self.variants["sync"].median_stall_s
        return self.variants["async"].median_stall_s / sync if sync else float("nan")

    @property
    def overhead_ratio(self) -> float:
        sync = self.overhead_s("sync")
        return self.overhead_s("async") / sync if sync > 0 else float("nan")


def _records(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run(config: str, overrides: list[str], workers: int, run_dir: str, extra: list[str]) -> list[dict[str, Any]]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={workers}",
        "-m",
        "rayllm.runtime.torchrun",
        config,
        *BENCH_OVERRIDES,
        *overrides,
        *extra,
        f"run.dir={run_dir}",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers))),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RayllmError(f"benchmark run failed ({' '.join(extra)}):\n{proc.stderr[-3000:]}")
    return _records(run_dir)


def _variant(name: str, records: list[dict[str, Any]]) -> Variant:
    first = next(r for r in records if r["kind"] == "first_step")
    last = [r for r in records if r["kind"] == "train"][-1]
    stalls = [r["stall_s"] for r in records if r["kind"] == "checkpoint" and not r.get("final")]
    return Variant(name, len(stalls), stalls, last["time"] - first["time"])


def run(
    config: str, overrides: list[str], workers: int = 2, steps: int = 30, every: int = 6, repeats: int = 2
) -> Result:
    """Each variant ``repeats`` times, interleaved; per variant the fastest run is kept (the least
    disturbed by the rest of the machine) with the median stall over all its checkpoints."""
    runs: dict[str, list[Variant]] = {"none": [], "sync": [], "async": []}
    start: dict[str, Any] = {}
    plan = {
        "none": ["train.checkpoint_every=1000000"],
        "sync": [f"train.checkpoint_every={every}", "train.async_checkpoint=false"],
        "async": [f"train.checkpoint_every={every}", "train.async_checkpoint=true"],
    }
    with tempfile.TemporaryDirectory(prefix="rayllm-bench-ckpt-") as root:
        for i in range(repeats):
            for name, extra in plan.items():
                run_dir = os.path.join(root, f"{name}-{i}")
                records = _run(config, overrides, workers, run_dir, [f"train.max_steps={steps}", *extra])
                runs[name].append(_variant(name, records))
                start = next(r for r in records if r["kind"] == "start")
    variants = {}
    for name, vs in runs.items():
        fastest = min(vs, key=lambda v: v.train_s)
        stalls = [s for v in vs for s in v.loop_stall_s]
        variants[name] = Variant(name, fastest.checkpoints, stalls, fastest.train_s)
    params = int(start["params"])
    # fp32 weights and AdamW's two moments: what each checkpoint writes, over all ranks.
    return Result(workers, steps, every, repeats, params, params * 4 * 3, variants)


def format_result(r: Result) -> str:
    sync, asyn = r.variants["sync"], r.variants["async"]
    lines = [
        f"checkpoint stall: {r.workers} ranks (torchrun, gloo), {r.params / 1e6:.1f}M parameters, "
        f"{r.state_bytes / 2**20:,.0f} MiB of model and optimizer state per checkpoint, "
        f"{r.steps} steps, a checkpoint every {r.every}; fastest of {r.repeats} interleaved runs each",
        f"  {'':<22}{'loop stall / ckpt':>20}{'wall overhead / ckpt':>24}{'train time':>12}",
        f"  {'no checkpoints':<22}{'-':>20}{'-':>24}{r.variants['none'].train_s:>11.1f}s",
    ]
    for label, v in (("synchronous", sync), ("async", asyn)):
        lines.append(
            f"  {label:<22}{v.median_stall_s:>19.3f}s{r.overhead_s(v.name):>23.3f}s{v.train_s:>11.1f}s"
            f"   ({v.checkpoints} checkpoints)"
        )
    goal = "met" if r.stall_ratio <= 0.10 else "NOT met"
    lines.append(f"  async / synchronous   {r.stall_ratio:>19.3f}{r.overhead_ratio:>24.3f}")
    lines.append(f"  goal: async loop stall <= 0.10 of synchronous: {goal}")
    return "\n".join(lines)
