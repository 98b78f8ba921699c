"""``rayllm bench recovery``: the time from a training worker's SIGKILL to the next completed step.

A run on the local Ray (or RAY_ADDRESS) trains as the config says; once it has passed
``--kill-after`` steps, one training worker process is killed with SIGKILL, as a crashed
process or an OOM kill would be. Ray Train notices, restarts the worker group, rayllm
restores the latest checkpoint (resharded) and resumes the data stream. From the driver's
progress records (metrics.jsonl, stamped as they arrive) the report gives:

- kill -> restarted: the new worker group has restored the checkpoint and starts its loop;
- kill -> next completed step: the first step the new group finishes;
- kill -> past the killed step: training is back where it was (the steps since the last
  checkpoint are trained again);
- beside them, the same run's cold start (driver start -> first step), for scale.

``compare`` runs it twice side by side: resuming from storage checkpoints only, then with
in-memory checkpoints every ``memory_every`` steps (checkpoint/memory.py), which a kill should
cost at most that many steps.

How often Ray Train's controller polls the workers (``cluster.health_check_interval_s``: 0.2 s
up to 100 workers by default) bounds how fast a death is seen.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import time

from rayllm.bench.common import read_records, train_in_thread
from rayllm.config import TrainConfig
from rayllm.errors import RayllmError


@dataclasses.dataclass
class Result:
    world_size: int
    killed_after_step: int
    resumed_from_step: int
    cold_start_s: float
    restart_s: float
    next_step_s: float
    caught_up_s: float
    step_time_s: float
    # Seconds from the kill to each stage of the new attempt's start-up (rank 0's clock).
    stages: dict[str, float] = dataclasses.field(default_factory=dict)
    stream_kept: bool | None = None  # the restart was served from the running data stream
    memory_stall_s: float | None = None  # an in-memory save's cost to the loop, median
    memory_write_s: float | None = None  # ... its time from start to marker, median (off the loop)

    @property
    def steps_lost(self) -> int:
        """Steps trained again: from the checkpoint resumed to the killed step."""
        return self.killed_after_step - self.resumed_from_step


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def _latest_step(run_dir: str) -> int:
    steps = [r["step"] for r in read_records(run_dir) if r["kind"] == "train"]
    return max(steps, default=0)


def run(config: TrainConfig, kill_after: int = 10, timeout_s: float = 900.0) -> Result:
    from rayllm.ray_cluster import connect_ray
    from rayllm.runtime.room import run_cpus

    if config.cluster.max_failures < 1:
        raise RayllmError("bench recovery needs cluster.max_failures >= 1 (the run must survive the kill)")
    t = config.train
    if t.checkpoint_every >= kill_after:
        raise RayllmError(
            f"train.checkpoint_every ({t.checkpoint_every}) must be below --kill-after ({kill_after}): "
            "the kill must come after a checkpoint, for example train.checkpoint_every=5"
        )
    t.log_every = 1  # every step's record, for the timings
    t.stop_at_step = kill_after + 2 * t.checkpoint_every  # enough to get past the killed step
    if t.stop_at_step > t.max_steps:
        raise RayllmError(f"train.max_steps must be at least {t.stop_at_step} for --kill-after {kill_after}")
    run_dir = config.run.dir
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise RayllmError(f"run.dir {run_dir} already holds a run; give the benchmark a fresh run.dir")
    connect_ray(config.cluster.address, run_cpus(config))
    import ray
    from ray.util.state import list_actors

    job = ray.get_runtime_context().get_job_id()  # on a shared cluster, kill only this run's workers

    started = time.time()
    thread, box, _ = train_in_thread(config)
    killed_at = None
    while thread.is_alive() and time.time() - started < timeout_s:
        if _latest_step(run_dir) >= kill_after:
            workers = list_actors(
                filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE"), ("job_id", "=", job)]
            )
            if workers:
                os.kill(workers[-1].pid, signal.SIGKILL)
                killed_at = time.time()
                break
        time.sleep(0.05)
    thread.join(timeout=max(1.0, timeout_s - (time.time() - started)))
    if "error" in box:
        raise RayllmError(f"the benchmark run failed: {box['error']}")
    if killed_at is None or "result" not in box:
        raise RayllmError("the benchmark run ended before a worker could be killed; raise train.max_steps")
    records = read_records(run_dir)
    before = [r for r in records if r["time"] < killed_at]
    after = [r for r in records if r["time"] >= killed_at]
    killed_step = max(r["step"] for r in before if r["kind"] == "train")
    restart = next(r for r in after if r["kind"] == "start")
    steps_after = [r for r in after if r["kind"] == "train"]
    caught_up = next(r for r in steps_after if r["step"] > killed_step)
    first = next(r for r in records if r["kind"] == "first_step")
    step_times = [r["step_time_s"] for r in before if r["kind"] == "train"][1:]
    first_after = next(r for r in after if r["kind"] == "first_step")
    marks = {**first_after.get("phases", {}), "started": restart["time"]}
    stages = {name: marks[key] - killed_at for key, name in STAGES.items() if marks.get(key) is not None}
    saves = [r for r in records if r["kind"] == "memory_checkpoint"]
    return Result(
        world_size=restart["world_size"],
        killed_after_step=killed_step,
        resumed_from_step=restart["step"],
        cold_start_s=first["time"] - started,
        restart_s=restart["time"] - killed_at,
        next_step_s=steps_after[0]["time"] - killed_at,
        caught_up_s=caught_up["time"] - killed_at,
        step_time_s=_median(step_times) or float("nan"),
        stages=stages,
        stream_kept=first_after.get("stream_kept"),
        memory_stall_s=_median([r["stall_s"] for r in saves]),
        memory_write_s=_median([r["write_s"] for r in saves if r.get("write_s") is not None]),
    )


# The new attempt's start-up, in order: record key -> row label.
STAGES = {
    "process": "new worker process",
    "loop": "train loop entered",
    "attempt": "attempt counted",
    "model": "model and optimizer built",
    "checkpointer": "process groups, checkpointer",
    "restored": "checkpoint restored",
    "started": "started (peak measured)",
    "stream": "data stream begun",
    "batch": "first batch in hand",
}


def compare(config: TrainConfig, kill_after: int = 10, memory_every: int = 1) -> list[tuple[str, Result]]:
    """The same kill three times, each run in a folder of its own under run.dir: storage
    checkpoints only; with in-memory checkpoints every ``memory_every`` steps as well, written in
    the background; and the same written in the loop (train.async_checkpoint: false, which makes
    the stored ones synchronous too)."""
    runs = []
    variants = [
        ("storage only", "storage", None, True),
        (f"in memory every {memory_every}", "memory", memory_every, True),
        ("... written in the loop", "memory-sync", memory_every, False),
    ]
    for label, folder, every, background in variants:
        each = copy.deepcopy(config)
        each.run.dir = f"{config.run.dir.rstrip('/')}/{folder}"
        each.train.memory_checkpoint_every = every
        each.train.async_checkpoint = background and config.train.async_checkpoint
        runs.append((label, run(each, kill_after)))
    return runs


def format_comparison(runs: list[tuple[str, Result]]) -> str:
    first = runs[0][1]
    rows = [
        ("resumed from step", lambda r: f"{r.resumed_from_step:d}"),
        ("steps lost (trained again)", lambda r: f"{r.steps_lost:d}"),
        ("data stream kept running", lambda r: {True: "yes", False: "no"}.get(r.stream_kept, "-")),
        *[(f"kill -> {name}", _stage(name)) for name in STAGES.values()],
        ("kill -> next completed step", lambda r: f"{r.next_step_s:.1f} s"),
        ("kill -> past the killed step", lambda r: f"{r.caught_up_s:.1f} s"),
        ("cold start -> first step", lambda r: f"{r.cold_start_s:.1f} s"),
        ("one step (median)", lambda r: f"{r.step_time_s:.2f} s"),
        ("in-memory save: stall (median)", _seconds("memory_stall_s")),
        ("in-memory save: marked after (median)", _seconds("memory_write_s")),
    ]
    width = max(len(label) for label, _ in runs) + 2
    lines = [
        f"recovery from a SIGKILLed training worker ({first.world_size} workers, killed after step "
        f"{first.killed_after_step})",
        " " * 40 + "".join(f"{label:>{width}}" for label, _ in runs),
    ]
    for name, cell in rows:
        lines.append(f"  {name:<38}" + "".join(f"{cell(r):>{width}}" for _, r in runs))
    return "\n".join(lines)


def _seconds(field: str):
    return lambda r: "-" if getattr(r, field) is None else f"{getattr(r, field):.3f} s"


def _stage(name: str):
    return lambda r: f"{r.stages[name]:.1f} s" if name in r.stages else "-"


def format_result(r: Result) -> str:
    return format_comparison([("this run", r)])
