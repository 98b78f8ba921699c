"""The driver: prepare data, connect to Ray, run a TorchTrainer, follow it, summarise.

This is the only code path for training: ``rayllm train``, ``jobs/pretrain.py`` under
``ray job submit`` and ``rayllm.train(...)`` from a script all come here.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_lib
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rayllm import events
from rayllm.checkpoint.lease import RunDirLease
from rayllm.checkpoint.memory import check_memory_budget, start_registry
from rayllm.config import TrainConfig
from rayllm.config.resolve import resolve
from rayllm.data.discover import prepare_data
from rayllm.data.order import first_batches
from rayllm.data.stream.server import start_server
from rayllm.errors import RayllmError
from rayllm.io.redact import display_uri
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import is_remote, join, pyarrow_filesystem, write_text
from rayllm.loop import fault_injection as faults
from rayllm.loop.data_resume import check_resume_data
from rayllm.loop.setup import import_init_weights
from rayllm.parallel.layout import usable_world_sizes
from rayllm.parallel.process_group import gpu_env
from rayllm.parallel.shape_counts import model_shape
from rayllm.ray_cluster import connect_ray, node_affinity, pinned_actor
from rayllm.runtime.control import RunControl
from rayllm.runtime.failure_policy import failure_message
from rayllm.runtime.monitor import RestartTiming, RunMonitor, dropped_text
from rayllm.runtime.room import run_cpus, wait_for_room, worker_bundle
from rayllm.runtime.signals import StopSignals


@dataclass
class TrainResult:
    """What a finished run gives back."""

    loss: float | None
    val_loss: float | None
    step: int
    tokens: int
    tokens_per_s: float | None
    checkpoint: str | None
    run_dir: str
    aim_repo: str | None
    aim_run_hash: str | None
    initial_val_loss: float | None = None
    seconds: float = 0.0
    seconds_to_first_step: float | None = None  # from the start to the run's first step
    restarts: list[RestartTiming] = field(default_factory=list)  # each restart's way back to a first step
    peak_memory_bytes: int | None = None
    # The realised mixture and any shards skipped (data.on_bad_shard: skip); also in run.dir/data_report.json.
    data_report: dict[str, Any] = field(default_factory=dict)
    # The signal (SIGTERM, SIGINT) that ended the run early, after a checkpoint; None when it ran to the end.
    stopped_by: str | None = None
    # Every train.keep_checkpoint_every-th checkpoint, copied to run.dir/kept/.
    kept_checkpoints: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def metrics(self) -> dict[str, Any]:
        return {"loss": self.loss, "val_loss": self.val_loss, "step": self.step, "tokens": self.tokens}


def _storage(config: TrainConfig, storage: StorageSettings) -> tuple[str, str, Any]:
    """(storage_path, name, filesystem) so that Ray Train's run folder is exactly run.dir."""
    fs, path = pyarrow_filesystem(config.run.dir, storage)
    path = path.rstrip("/")
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    return parent or "/", name, fs


def _thread_env(config: TrainConfig) -> dict[str, str]:
    """CPU threads per worker, set before the worker starts.

    Ray Train V2 workers start without OMP_NUM_THREADS, and the loop runs in a thread of Ray's, so
    torch's one thread per core would oversubscribe co-located workers. Fault injection passes.
    On GPU the allocator's and NCCL's settings (gpu_env): Ray Train starts CUDA before the loop.
    """
    passed = {name: os.environ[name] for name in faults.ENV_VARS if name in os.environ}
    if config.cluster.use_gpu:
        return {**gpu_env(), **passed}
    threads = str(max(1, int(config.cluster.cpus_per_worker)))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **passed}


def health_check_interval_s(config: TrainConfig) -> float:
    """How often Ray Train's controller polls the workers: how soon it sees a death, a reported
    checkpoint becomes resumable, a started group begins and a finished run ends (Ray's own 2 s
    cost a 2-worker test run 5 of its 27 s). Each poll calls every worker, so the interval grows
    with them: 0.2 s up to 100 workers, Ray's 2 s at 1,000."""
    if config.cluster.health_check_interval_s is not None:
        return config.cluster.health_check_interval_s
    return min(2.0, max(0.2, config.worker_range[1] / 500))


@contextlib.contextmanager
def _controller_env(config: TrainConfig):
    """Ray Train's controller reads some settings only from its environment, which Ray Train
    copies from the driver's when ``fit()`` starts it; set them for that call only."""
    settings = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(health_check_interval_s(config))}
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


WORKER_SETUP_HOOK = "rayllm.runtime.signals.install_in_worker"


def _signal_hook_env() -> dict[str, str]:
    """Every training worker process gets rayllm's SIGTERM handler (a preempted node checkpoints).

    Ray runs a ``worker_process_setup_hook`` in a worker's main thread before any task, but turns
    the runtime-env field into the variable its worker reads only for a job's runtime env, not
    for an actor's (Ray 2.60, ray/_private/runtime_env/setup_hook.py); so the variable is set here.
    """
    from ray._private import ray_constants

    return {ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: WORKER_SETUP_HOOK}


def _start_stream(config: TrainConfig, plans):
    """The run's data stream server (data/stream/server.py), on the driver's node: the driver owns it, so a restart
    after a lost worker finds the stream running and resumes from it when the checkpoint's step is
    among those it kept: the steps back to the latest checkpoint and the ranks' prefetch."""
    t = config.train
    keep_behind = max(t.checkpoint_every, 2 * (t.memory_checkpoint_every or 0)) + PREFETCHED_STEPS
    return start_server(
        global_batch=t.global_batch_size,
        tokenize_tasks=config.data.tokenize_tasks,
        keep_behind=keep_behind,
    )


# Steps a rank may hold beyond the one it trains: its prefetch queue and the one being put in it.
PREFETCHED_STEPS = 4


def _stop_requested(name: str, control) -> None:
    """The driver's first SIGTERM/SIGINT: every rank checkpoints at the next step, then the run ends."""
    print(f"[rayllm] {name}: saving a checkpoint at the next step, then stopping", flush=True)
    control.request_stop.remote()


def train(config: TrainConfig, *, quiet: bool = False) -> TrainResult:
    """Train as ``config`` says and return the final metrics and the latest checkpoint."""
    started = time.time()
    log = (lambda *_: None) if quiet else (lambda text: print(f"[rayllm] {text}", flush=True))
    # Before anything else: a second run on a live run's dir is refused here (checkpoint/lease.py).
    lease = RunDirLease(config.run.dir, config.storage, config.run.lease_timeout_s, log=_warn)
    lease.acquire()
    try:
        plans = _prepare_run(config, log)
        connect_ray(config.cluster.address, run_cpus(config))
        if config.train.memory_checkpoint_every:  # before any worker: the keepers' bytes fit the nodes
            if not check_memory_budget(model_shape(config.model).total, config.train, config.worker_range[1]):
                log(
                    "in-memory checkpoints: no node for workers is up yet; their budget is checked at the first attempt"
                )
        wait_for_room(config, log)
        monitor = RunMonitor(config, quiet=quiet)
        driver = _start_driver_actors(config, plans)
        lease.on_lost = lambda _: driver.control.request_stop.remote()  # rank 0 then names the new owner
        signals = StopSignals(on_first=lambda name: _stop_requested(name, driver.control))
        result = _fit(_trainer(config, driver), config, driver, monitor, signals)
        summary = _summary(config, result, monitor, signals, started)
    finally:
        lease.release()
    if not quiet:
        print(format_summary(summary), flush=True)
    return summary


def _warn(text: str) -> None:
    print(f"[rayllm] {text}", file=sys.stderr, flush=True)


def _prepare_run(config: TrainConfig, log):
    """Before Ray: the config resolved (model.init_from's shape and tokenizer, read once, here on the
    driver), the data plans, model.init_from's weights, and the resolved config in run.dir."""
    resolve(config)
    plans = check_resume_data(config, prepare_data(config, log=log), log)  # changed data refused here
    import_init_weights(config, log)
    write_text(join(config.run.dir, "config.yaml"), config.to_redacted_yaml(), config.storage)
    return plans


@dataclass
class _DriverActors:
    """What the driver starts and owns for one run, beside it on its node, outliving every attempt."""

    records: Any  # the progress queue the monitor reads
    control: Any  # RunControl, which owns the nodes' relays
    control_name: str  # ... by the name Ray Train's controller finds it (its failure policy)
    keepers: str | None  # the in-memory checkpoints' registry name
    registry: Any  # ... and that registry, which owns the keepers
    stream: Any  # the data stream server
    sealed: StorageSettings  # the storage settings, credentials only in the driver's vault
    plans: Any  # the data plans, with the sealed storage


def _start_driver_actors(config: TrainConfig, plans) -> _DriverActors:
    """The driver's own actors live on the driver's node: a lost worker node must not take them along
    (the driver's node lives as long as the driver)."""
    from ray.util.queue import Queue

    records: Queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": node_affinity()})
    control_name = f"rayllm-control-{uuid.uuid4().hex[:12]}"
    control = pinned_actor(RunControl, name=control_name).remote()
    # In-memory checkpoints' keepers, owned through this registry by the driver: they outlive attempts.
    keepers = f"rayllm-keepers-{uuid.uuid4().hex[:12]}" if config.train.memory_checkpoint_every else None
    registry = start_registry(keepers) if keepers else None
    # Credentials, and the real form of every path with a password or a signature in it, travel
    # only through the driver's vault (io/credentials.py), never as task arguments: the config and
    # the plans go redacted, and the sealed settings give each process the real path it opens.
    sealed = config.storage.with_secret_paths([*config.secret_paths(), *plans.paths()]).sealed()
    plans = plans.with_storage(sealed)
    stream = _start_stream(config, plans)
    return _DriverActors(records, control, control_name, keepers, registry, stream, sealed, plans)


def _trainer(config: TrainConfig, driver: _DriverActors):
    """Ray Train's trainer for the run: the workers' loop, its inputs, scaling and storage."""
    import ray
    import ray.train

    from rayllm.runtime.ray_trainer import RayllmTorchTrainer
    from rayllm.runtime.ray_worker import train_loop_per_worker

    storage_path, name, fs = _storage(config, driver.sealed)
    lo, hi = config.worker_range
    t = config.train
    plans = driver.plans
    return RayllmTorchTrainer(
        train_loop_per_worker,
        # The config travels redacted; its credentials stay in the driver's vault, never shown as text.
        train_loop_config={
            "config": config.redacted(),
            "storage": driver.sealed,
            "queue": driver.records,
            "plans": plans,
            "control": driver.control,
            "keepers": driver.keepers,
            "stream": driver.stream,
            # Validation is tokenized once per run, here, not once per rank.
            "validation": ray.put(first_batches(plans.val, t.val_batches, t.global_batch_size) if plans.val else []),
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=lo if lo == hi else (lo, hi),
            elastic_resize_monitor_interval_s=config.cluster.resize_interval_s,
            use_gpu=config.cluster.use_gpu,
            resources_per_worker=worker_bundle(config),
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=fs,
            failure_config=ray.train.FailureConfig(max_failures=config.cluster.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.train.keep_checkpoints),
            # Progress reaches the driver through the monitor; Ray Train's per-report lines are noise.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": {**_thread_env(config), **_signal_hook_env()}},
        ),
        usable_world_sizes=usable_world_sizes(config.parallel, lo, hi, t.global_batch_size, t.micro_batch_size),
        control_name=driver.control_name,
    )


def _fit(trainer, config: TrainConfig, driver: _DriverActors, monitor: RunMonitor, signals: StopSignals):
    """Run the trainer while a thread feeds the progress records to the monitor; then drain the
    records, close the monitor and end the driver's actors, however the run ended."""
    records = driver.records
    stop = threading.Event()

    def handle(record: dict[str, Any]) -> None:
        monitor.handle(events.from_record(record))  # records cross the queue (RaySession.emit)

    def follow() -> None:
        while not stop.is_set():
            try:
                handle(records.get(timeout=0.5))
            except queue_lib.Empty:
                continue
            except Exception:
                if stop.is_set():
                    return
                time.sleep(0.5)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    signals.install()
    try:
        with _controller_env(config):
            return trainer.fit()
    except Exception as e:
        raise RayllmError(f"training failed: {failure_message(e)}") from e
    finally:
        signals.restore()
        stop.set()
        follower.join(timeout=5)
        while True:
            try:
                handle(records.get_nowait())
            except Exception:
                break
        monitor.close()
        _end_driver_actors(driver)


def _end_driver_actors(driver: _DriverActors) -> None:
    import ray

    try:
        driver.records.shutdown()
        ray.kill(driver.control)  # and the relays it owns
        ray.kill(driver.stream)
        if driver.registry is not None:
            ray.kill(driver.registry)  # and the keepers it owns, with every in-memory checkpoint
    except Exception:
        pass


def _summary(config: TrainConfig, result, monitor: RunMonitor, signals: StopSignals, started: float) -> TrainResult:
    """What Ray Train's result and the monitor say of the finished run."""
    metrics = dict(result.metrics or {})
    checkpoint = result.checkpoint.path if result.checkpoint else None
    if checkpoint and is_remote(config.run.dir):
        checkpoint = f"{config.run.dir.split('://', 1)[0]}://{checkpoint}"
    return TrainResult(
        loss=metrics.get("loss"),
        val_loss=metrics.get("val_loss", monitor.val_loss),
        step=int(metrics.get("step", 0)),
        tokens=int(metrics.get("tokens", 0)),
        tokens_per_s=metrics.get("tokens_per_s"),
        checkpoint=checkpoint,
        run_dir=config.run.dir,
        aim_repo=monitor.tracker.repo if monitor.tracker.run_hash else None,
        aim_run_hash=monitor.tracker.run_hash,
        initial_val_loss=monitor.initial_val_loss,
        seconds=time.time() - started,
        seconds_to_first_step=(monitor.first_step_at - started) if monitor.first_step_at else None,
        restarts=list(monitor.restarts),
        peak_memory_bytes=metrics.get("peak_memory_bytes"),
        data_report=monitor.data_report(),
        stopped_by=signals.name,
        kept_checkpoints=list(monitor.kept),
        history=monitor.history,
    )


def format_summary(r: TrainResult) -> str:
    def num(v, fmt):
        return format(v, fmt) if v is not None else "n/a"

    lines = [
        "[rayllm] done",
        f"  step            {r.step}",
        f"  loss            {num(r.loss, '.4f')}",
        f"  val loss        {num(r.val_loss, '.4f')}"
        + (f" (step 0: {r.initial_val_loss:.4f})" if r.initial_val_loss else ""),
        f"  tokens          {r.tokens:,}",
        f"  tokens/s        {num(r.tokens_per_s, ',.0f')}",
        f"  wall time       {r.seconds:.0f} s"
        + (f" ({r.seconds_to_first_step:.0f} s to the first step)" if r.seconds_to_first_step else ""),
        f"  peak memory     {num(r.peak_memory_bytes / 2**20 if r.peak_memory_bytes else None, ',.0f')} MiB per worker",
        f"  checkpoint      {display_uri(r.checkpoint) if r.checkpoint else None}",
        f"  run dir         {display_uri(r.run_dir)}",
    ]
    if r.restarts:  # each from its failure, not from the run's start
        back = ", ".join(f"{t.seconds_to_first_step:.0f} s (resumed at step {t.step})" for t in r.restarts)
        lines.append(f"  restarts        {len(r.restarts)}; from each failure to the next step: {back}")
    mixture = r.data_report.get("mixture") or {}
    if len(mixture) > 1:
        lines.append("  mixture         " + ", ".join(f"{name} {share:.1%}" for name, share in mixture.items()))
    skipped = r.data_report.get("skipped_shards") or []
    if skipped:
        lines.append(f"  skipped shards  {len(skipped)} (listed in {display_uri(r.run_dir)}/data_report.json)")
    for source, counts in (r.data_report.get("dropped_records") or {}).items():
        lines.append(f"  left out        {source}: {dropped_text(counts)} record(s)")
    if r.aim_run_hash:
        lines.append(f"  aim run         {r.aim_run_hash} in {r.aim_repo}  (view: aim up --repo {r.aim_repo})")
    return "\n".join(lines)
