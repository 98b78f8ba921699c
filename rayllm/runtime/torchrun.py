"""The per-rank loop under plain torch.distributed, without Ray.

    torchrun --nproc_per_node 2 -m rayllm.runtime.torchrun configs/tiny.yaml run.dir=/tmp/r

The data stream is the same ordered stream the Ray pipeline produces, computed
in-process; checkpoints go to ``run.dir/checkpoint_XXXXXXXX`` (a local or shared path),
complete once rayllm's commit marker is in them (rayllm.checkpoint.store).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

import numpy as np
import torch.distributed as dist

from rayllm import events
from rayllm.checkpoint.lease import RunDirLease, RunDirTaken
from rayllm.config import TrainConfig
from rayllm.config.resolve import resolve
from rayllm.data.discover import DataSpecs, prepare_data
from rayllm.data.order import DataSlicing, DataState, first_batches, local_stream, rank_slice
from rayllm.errors import RayllmError
from rayllm.io.storage import is_remote
from rayllm.loop.data_resume import check_resume_data
from rayllm.loop.setup import import_init_weights
from rayllm.loop.trainer import Trainer
from rayllm.loop.watchdog import SLOW_PHASE_S
from rayllm.parallel.process_group import init_group, local_device, long_barrier
from rayllm.runtime.monitor import RunMonitor
from rayllm.runtime.signals import StopSignals

SIGNALS = StopSignals(
    on_first=lambda name: print(f"[rayllm] {name}: saving a checkpoint, then stopping", file=sys.stderr, flush=True)
)


class LocalSession:
    def __init__(self, config: TrainConfig, plans: DataSpecs, monitor: RunMonitor | None):
        self.config, self.plans, self.monitor = config, plans, monitor
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.device = local_device(config.cluster.use_gpu)
        self.train_spec, self.val_spec = plans.train, plans.val
        self.prunes_checkpoints = True  # no Ray Train here to keep the last K
        self.memory_root = None  # in-memory checkpoints need Ray's object store
        self.node = socket.gethostname()
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) + 1
        self.phases: dict[str, float] = {"loop": time.time()}
        self.stream_kept: bool | None = None  # every attempt computes its stream afresh

    def train_batches(self, state: DataState, consumed: int, slicing: DataSlicing):
        """Every rank computes the same global stream in-process and keeps its slice (no Ray here)."""
        stream = local_stream(
            self.train_spec, state, consumed=consumed, global_batch=self.config.train.global_batch_size
        )
        slice_, slices = slicing.slice_of(self.rank), slicing.slices
        return ((rank_slice(rows, slice_, slices), meta) for rows, meta in stream)

    def peak_flops(self, measure) -> float:
        return measure()  # each torchrun start is a fresh run: nothing to remember it by

    def validation_batches(self) -> list[np.ndarray]:
        """Collective: rank 0 packs the validation batches and broadcasts them, so they are
        tokenized once per run, not once per rank."""
        t = self.config.train
        box = [first_batches(self.val_spec, t.val_batches, t.global_batch_size) if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def register(self, step: int, metrics: dict[str, Any], uri: str) -> None:
        pass  # the commit marker is the whole registration

    def report(self, metrics: dict[str, Any]) -> None:
        pass

    def stop_requested(self) -> bool:
        return SIGNALS.requested.is_set()

    def preempted(self) -> bool:
        return False  # torchrun forwards a signal to every rank: it is a stop of the whole run

    def emit(self, event: events.RunEvent) -> None:
        if self.monitor is not None:  # rank 0's, in this process: the event itself
            self.monitor.handle(event)


def run(config: TrainConfig, quiet: bool = False) -> dict[str, Any]:
    """Train on the process group torchrun set up (initialised here when it is not yet)."""
    if is_remote(config.run.dir):
        raise RayllmError("under torchrun, run.dir must be a local or shared path; use the Ray path for s3://")
    if not dist.is_initialized():
        init_group(local_device(config.cluster.use_gpu))
    rank = dist.get_rank()
    resolve(config)  # model.init_from's shape, read by each process here: torchrun has no driver
    lease = None
    try:
        lease = _take_run_dir(config, rank)
        rank0_done = long_barrier(SLOW_PHASE_S, "rank 0 to prepare the data and model.init_from")
        if rank == 0:
            log = (lambda *_: None) if quiet else print
            plans = prepare_data(config, log=log)
            import_init_weights(config, log)
        rank0_done()
        if rank != 0:
            plans = prepare_data(config, log=lambda *_: None)
        # Every process checks the data against the checkpoint (and raises alike); rank 0 says so.
        say = (lambda *_: None) if quiet or rank else (lambda text: print(f"[rayllm] {text}"))
        plans = check_resume_data(config, plans, say, keeps_tokenizer=rank == 0)
        monitor = RunMonitor(config, quiet=quiet) if rank == 0 else None
        try:
            metrics = Trainer(config, LocalSession(config, plans, monitor)).fit()
        finally:
            if monitor is not None:
                monitor.close()
        return metrics
    finally:
        if lease is not None:
            lease.release()
        dist.destroy_process_group()


def _take_run_dir(config: TrainConfig, rank: int) -> RunDirLease | None:
    """Collective: rank 0 takes run.dir's lease (checkpoint/lease.py) before anything starts; a
    refusal reaches every rank, so that all end with the one line, none waiting at a barrier."""
    lease, refusal = None, [None]
    if rank == 0:
        lease = RunDirLease(config.run.dir, config.storage, config.run.lease_timeout_s, log=_warn)
        lease.on_lost = lambda _: SIGNALS.requested.set()  # every rank stops at the next step
        try:
            lease.acquire()
        except RunDirTaken as e:
            refusal[0], lease = str(e), None
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise RunDirTaken(refusal[0])
    return lease


def _warn(text: str) -> None:
    print(f"[rayllm] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: torchrun ... -m rayllm.runtime.torchrun CONFIG [key=value ...]", file=sys.stderr)
        return 2
    SIGNALS.install()
    try:
        # The world is torchrun's: the layout and the batch split are checked against it.
        world = [f"cluster.num_workers={os.environ['WORLD_SIZE']}"] if "WORLD_SIZE" in os.environ else []
        config = TrainConfig.from_yaml(argv[0], overrides=[*argv[1:], *world])
        metrics = run(config)
    except RayllmError as e:
        print(f"rayllm: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", 0)) == 0:
        print(
            f"[rayllm] done: step {metrics.get('step')} loss {metrics.get('loss')} val_loss {metrics.get('val_loss')}"
        )
    if SIGNALS.requested.is_set():
        return 128 + signal.SIGTERM  # stopped early (with a checkpoint), as schedulers expect
    return 0


if __name__ == "__main__":
    sys.exit(main())
