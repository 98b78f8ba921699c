"""The per-rank loop as a Ray Train worker: data from dataset shards, checkpoints via report."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from typing import Any

import torch

from rayllm.config import TrainConfig
from rayllm.data.order import DataState
from rayllm.data.ray_stream import served_batches, start_server
from rayllm.errors import RayllmError
from rayllm.trainer.loop import Trainer


class RaySession:
    def __init__(self, config: TrainConfig, queue, plans, control=None):
        import ray.train

        self._train = ray.train
        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self._queue = queue if self.rank == 0 else None
        self.config = config
        self.train_plan, self.val_plan = plans.train, plans.val
        self._server = None
        self._control = control if self.rank == 0 else None  # the driver's stop flag (an actor)
        self._stop_checked_at = 0.0
        self._stop = False
        self._emit_failed = False
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            import ray.train.torch

            self.device = ray.train.torch.get_device()
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

    def train_batches(self, state: DataState, consumed: int):
        """Rank 0 starts this attempt's stream server; every rank then pulls its slices from it."""
        import uuid

        import ray
        import torch.distributed as dist

        name = [f"rayllm-stream-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None]
        if self.rank == 0:
            self._server = start_server(
                self.train_plan,
                state,
                consumed=consumed,
                global_batch=self.config.train.global_batch_size,
                world_size=self.world_size,
                parallelism=self.config.data.tokenize_tasks,
                name=name[0],
            )
        if self.world_size > 1:
            dist.broadcast_object_list(name, src=0)
        server = self._server if self.rank == 0 else ray.get_actor(name[0])
        return served_batches(server, self.rank)

    def close(self) -> None:
        if self._server is not None:
            import ray

            ray.kill(self._server)
            self._server = None

    def restore_dir(self):
        ckpt = self._train.get_checkpoint()
        return ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(None)

    def checkpoint_dir(self, step: int) -> str:
        """Every rank writes its shards into a local folder of its own; Ray merges them in storage."""
        return tempfile.mkdtemp(prefix=f"rayllm-ckpt-{step:08d}-r{self.rank}-")

    def commit(self, step: int, metrics: dict[str, Any], directory: str, upload_async: bool) -> None:
        """Ray Train uploads the folders (in the background when async) and registers the
        checkpoint only once every rank's upload is done, so a crash mid-save leaves the
        previous checkpoint the latest; the local folder is deleted after its upload."""
        mode = self._train.CheckpointUploadMode
        try:
            self._train.report(
                dict(metrics),
                checkpoint=self._train.Checkpoint.from_directory(directory),
                checkpoint_dir_name=f"checkpoint_{step:08d}",
                checkpoint_upload_mode=mode.ASYNC if upload_async else mode.SYNC,
                delete_local_checkpoint_after_upload=True,
            )
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def report(self, metrics: dict[str, Any]) -> None:
        self._train.report(dict(metrics))

    def stop_requested(self) -> bool:
        """Rank 0 asks the driver's flag at most once a second; the loop shares the answer."""
        if self._control is None or self._stop:
            return self._stop
        now = time.monotonic()
        if now - self._stop_checked_at >= 1.0:
            import ray

            self._stop_checked_at = now
            try:
                self._stop = bool(ray.get(self._control.requested.remote(), timeout=5))
            except Exception:  # the driver is gone or busy: keep training, ask again later
                pass
        return self._stop

    def emit(self, record: dict[str, Any]) -> None:
        """Progress to the driver; never worth stopping training over (the driver may be gone)."""
        if self._queue is None:
            return
        try:
            self._queue.put_nowait(record)
        except Exception as e:
            if not self._emit_failed:
                logging.getLogger(__name__).warning("progress records no longer reach the driver: %s", e)
            self._emit_failed = True


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    # Progress reaches the driver through the monitor; Ray Data's per-execution lines are noise there.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    try:  # Ray Train names this logger by its file path, out of reach of LoggingConfig
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
    import ray

    config = TrainConfig.from_dict(loop_config["config"])
    config.data.storage = loop_config["storage"]  # sealed: its credentials come from Ray's object store
    threads = max(1, int(config.cluster.cpus_per_worker))
    if not config.cluster.use_gpu:
        torch.set_num_threads(threads)
    control = loop_config.get("control")
    if control is not None:
        import ray

        earlier = ray.get(control.fatal.remote())
        if earlier:  # an earlier attempt hit an error no restart fixes: fail now, with its message
            raise RayllmError(earlier)
    session = RaySession(config, loop_config["queue"], loop_config["plans"], control)
    try:
        Trainer(config, session).fit()
    except RayllmError as e:
        if control is not None:
            import ray

            ray.get(control.set_fatal.remote(str(e)))
        raise
