"""The per-rank loop under plain torch.distributed, without Ray.

    torchrun --nproc_per_node 2 -m rayllm.trainer.torchrun configs/tiny.yaml run.dir=/tmp/r

The data stream is the same ordered stream the Ray pipeline produces, computed
in-process; checkpoints go to ``run.dir/checkpoint_XXXXXXXX`` (a local or shared path),
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from rayllm.config import TrainConfig
from rayllm.data.order import DataState, local_stream, rank_slice
from rayllm.data.plan import DataPlans, prepare_data
from rayllm.errors import RayllmError
from rayllm.storage import is_remote
from rayllm.trainer.loop import Trainer
from rayllm.trainer.milestones import KEPT_DIR, is_milestone
from rayllm.trainer.monitor import RunMonitor

_STOP = threading.Event()  # set by SIGTERM/SIGINT: checkpoint at the next step and end


def _request_stop(signum, frame) -> None:
    if _STOP.is_set():  # a second signal: stop now
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)
    _STOP.set()
    print(f"[rayllm] {signal.Signals(signum).name}: saving a checkpoint, then stopping", file=sys.stderr, flush=True)


class LocalSession:
    def __init__(self, config: TrainConfig, plans: DataPlans, monitor: RunMonitor | None):
        self.config, self.plans, self.monitor = config, plans, monitor
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if config.cluster.use_gpu:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.run_dir = os.path.abspath(config.run.dir)
        self.train_plan, self.val_plan = plans.train, plans.val
        # Rank 0 copies milestones and deletes old checkpoints off the step loop: removing a
        # checkpoint's files takes as long as a small model's step.
        self._tidier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayllm-tidy") if self.rank == 0 else None

    def train_batches(self, state: DataState, consumed: int):
        """Every rank computes the same global stream in-process and keeps its slice (no Ray here)."""
        stream = local_stream(
            self.train_plan, state, consumed=consumed, global_batch=self.config.train.global_batch_size
        )
        return ((rank_slice(rows, self.rank, self.world_size), meta) for rows, meta in stream)

    def checkpoints(self) -> list[str]:
        found = glob.glob(os.path.join(self.run_dir, "checkpoint_[0-9]*"))
        return sorted(p for p in found if not p.endswith(".tmp") and os.path.exists(os.path.join(p, ".metadata")))

    def restore_dir(self):
        existing = self.checkpoints()
        return contextlib.nullcontext(existing[-1] if existing else None)

    def checkpoint_dir(self, step: int) -> str:
        """One shared folder under a temporary name: resume never picks it before the rename."""
        return os.path.join(self.run_dir, f"checkpoint_{step:08d}.tmp")

    def commit(self, step: int, metrics: dict[str, Any], directory: str, upload_async: bool) -> None:
        final = os.path.join(self.run_dir, f"checkpoint_{step:08d}")
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)  # left by an earlier attempt that got this far
            os.replace(directory, final)  # atomic on one filesystem: complete, or not there
            self._tidier.submit(self._tidy, step, final)
        dist.barrier()

    def _tidy(self, step: int, final: str) -> None:
        """Rank 0, in the background and in commit order: keep a milestone's copy, drop old checkpoints."""
        if is_milestone(step, self.config.train.keep_checkpoint_every):
            kept = os.path.join(self.run_dir, KEPT_DIR, os.path.basename(final))
            shutil.rmtree(kept + ".tmp", ignore_errors=True)
            shutil.copytree(final, kept + ".tmp")
            os.replace(kept + ".tmp", kept)
        for old in self.checkpoints()[: -self.config.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self._tidier is not None:
            self._tidier.shutdown(wait=True)

    def report(self, metrics: dict[str, Any]) -> None:
        pass

    def stop_requested(self) -> bool:
        return _STOP.is_set()

    def emit(self, record: dict[str, Any]) -> None:
        if self.monitor is not None:
            self.monitor.handle(record)


def run(config: TrainConfig, quiet: bool = False) -> dict[str, Any]:
    """Train on the process group torchrun set up (initialised here when it is not yet)."""
    if is_remote(config.run.dir):
        raise RayllmError("under torchrun, run.dir must be a local or shared path; use the Ray path for s3://")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if config.cluster.use_gpu else "gloo")
    rank = dist.get_rank()
    try:
        if rank == 0:
            plans = prepare_data(config, log=(lambda *_: None) if quiet else print)
        dist.barrier()
        if rank != 0:
            plans = prepare_data(config, log=lambda *_: None)
        monitor = RunMonitor(config, quiet=quiet) if rank == 0 else None
        try:
            metrics = Trainer(config, LocalSession(config, plans, monitor)).fit()
        finally:
            if monitor is not None:
                monitor.close()
        return metrics
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: torchrun ... -m rayllm.trainer.torchrun CONFIG [key=value ...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    try:
        config = TrainConfig.from_yaml(argv[0], overrides=argv[1:])
        metrics = run(config)
    except RayllmError as e:
        print(f"rayllm: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", 0)) == 0:
        print(
            f"[rayllm] done: step {metrics.get('step')} loss {metrics.get('loss')} val_loss {metrics.get('val_loss')}"
        )
    if _STOP.is_set():
        return 128 + signal.SIGTERM  # stopped early (with a checkpoint), as schedulers expect
    return 0


if __name__ == "__main__":
    sys.exit(main())
