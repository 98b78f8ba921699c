"""The per-rank loop as a Ray Train worker: data from the stream server, checkpoints registered by report."""

from __future__ import annotations

import logging
import posixpath
import time
from typing import Any

import torch

from rayllm import events
from rayllm.checkpoint import checkpoint_name
from rayllm.checkpoint.memory import check_memory_budget, memory_uri
from rayllm.config import TrainConfig
from rayllm.data.order import DataSlicing, DataState
from rayllm.data.stream.protocol import RESTART, DataStreamLost
from rayllm.data.stream.relay import served_batches, slices_per_object
from rayllm.errors import RayllmError
from rayllm.loop.trainer import Trainer
from rayllm.parallel.shape_counts import model_shape
from rayllm.runtime.control import failure_record
from rayllm.runtime.interruption import node_settings
from rayllm.runtime.signals import WORKER


class RaySession:
    def __init__(self, config: TrainConfig, queue, plans, control=None, validation=None, keepers=None, stream=None):
        import ray
        import ray.train

        self._train = ray.train
        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.local_world_size = context.get_local_world_size()
        self._queue = queue  # progress from rank 0; failures from any rank
        self.config = config
        self.train_spec, self.val_spec = plans.train, plans.val
        self._stream = stream  # the run's stream server (serve.py)
        self._validation = validation  # an object ref: the validation batches
        self._control = control  # the run's control actor (control.py): stop flag, relays, peak
        self.node = f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"
        self.attempt = 1  # set once the attempt is counted (train_loop_per_worker)
        self._stop_checked_at = 0.0
        self._stop = False
        self._emit_failed = False
        self.prunes_checkpoints = False  # Ray Train keeps the last K it has registered
        # The driver's registry of in-memory checkpoint keepers (checkpoint/memory.py), if any.
        self.memory_root = memory_uri(keepers, "run") if keepers else None
        self._preemption_context = _preemption_context()
        self._watch_node(ray.get_runtime_context().get_node_id())
        # Wall-clock times of this attempt's start-up, for ``rayllm bench recovery``'s breakdown.
        self.phases = {"process": _process_started(), "loop": time.time()}
        self.stream_kept: bool | None = None  # whether this attempt's data came from the running stream
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            import ray.train.torch

            self.device = ray.train.torch.get_device()
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

    def train_batches(self, state: DataState, consumed: int, slicing: DataSlicing):
        """Rank 0 tells the run's stream server (the driver's, serve.py) where this attempt begins;
        every rank pulls its slices through its node's relay (relay.py), which the control actor
        keeps across attempts."""
        import ray
        import torch.distributed as dist

        node = ray.get_runtime_context().get_node_id()
        nodes = [node] * self.world_size  # each rank's node, by id
        if self.world_size > 1:
            dist.all_gather_object(nodes, node)
        server = self._stream
        kept = [None]
        if self.rank == 0:
            begin = server.begin.remote(
                self.attempt,
                state.to_dict(),
                consumed,
                slicing,
                # One object per node's data ranks: a node pulls its rows once, its ranks view them.
                slices_per_object(nodes, slicing),
                self.train_spec,  # the run's plan: a server Ray restarted has it only from here
            )
            kept[0] = _answer(begin, self.config.data.wait_timeout_s)
        if self.world_size > 1:
            dist.broadcast_object_list(kept, src=0)  # no rank asks before the server has begun
        self.stream_kept, self.phases["stream"] = kept[0], time.time()
        relay = _answer(self._control.relay.remote(node, server), self.config.data.wait_timeout_s)
        timeout = self.config.data.wait_timeout_s
        return served_batches(relay, self.attempt, nodes.count(node), self.rank, timeout)

    def peak_flops(self, measure) -> float:
        """Every rank's matmul peak together: ``measure()`` (collective) at the first attempt of
        this world size, then remembered by the run's control actor (0.6 s of every restart)."""
        import ray

        known = ray.get(self._control.peak_flops.remote(self.world_size), timeout=60)
        if known is None:  # the same answer on every rank: rank 0 stores only after the collective
            known = measure()
            if self.rank == 0:
                self._control.remember_peak_flops.remote(self.world_size, known)
        return known

    def validation_batches(self) -> list:
        """Packed once by the driver (launch.py) and fetched from the object store, once per node."""
        import ray

        return ray.get(self._validation, timeout=self.config.data.wait_timeout_s)

    def register(self, step: int, metrics: dict[str, Any], uri: str) -> None:
        """Ray Train records the complete checkpoint, already in its run folder, for its retention of
        the last K and for the run's result. Its report queue holds one entry until the controller's
        next poll (seconds), so the report goes through Ray's async path, whose upload step is here a
        no-op, instead of stalling the step loop."""
        storage = self._train.get_context().get_storage()
        path = posixpath.join(storage.experiment_fs_path, checkpoint_name(step))
        self._train.report(
            dict(metrics),
            checkpoint=self._train.Checkpoint(path, filesystem=storage.storage_filesystem),
            checkpoint_dir_name=checkpoint_name(step),
            checkpoint_upload_mode=self._train.CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=_already_stored,
            delete_local_checkpoint_after_upload=False,  # the "local" folder is the stored checkpoint
        )

    def report(self, metrics: dict[str, Any]) -> None:
        self._train.report(dict(metrics))

    def stop_requested(self) -> bool:
        """Rank 0 asks the driver's flag at most once a second; the loop shares the answer."""
        if self._control is None or self.rank != 0 or self._stop:
            return self._stop
        now = time.monotonic()
        if now - self._stop_checked_at >= 1.0:
            import ray

            self._stop_checked_at = now
            try:
                self._stop = bool(ray.get(self._control.stop_requested.remote(), timeout=5))
            except Exception:  # the driver is gone or busy: keep training, ask again later
                pass
        return self._stop

    def preempted(self) -> bool:
        """A SIGTERM to this worker process (a spot reclaim, a drain), or Ray's notice that this
        worker's node is being preempted: checkpoint at the next step, then restart without it."""
        if WORKER.requested.is_set():
            return True
        preemption = self._preemption_context
        info = preemption.preemption_info if preemption is not None else None
        return info is not None and self.rank in info.preempted_ranks

    def _watch_node(self, node: str) -> None:
        """This node's interruption watcher (interruption.py), when the config or the node names a
        notice to watch: the control actor starts it on the first ask, and keeps it."""
        c = self.config.cluster
        settings = node_settings(c.interruption_notice, c.interruption_endpoint)
        if settings is not None and self._control is not None:
            self._control.watch_node.remote(node, settings)

    def emit(self, event: events.RunEvent) -> None:
        """Progress to the driver; never worth stopping training over (the driver may be gone). It
        goes as its record, a plain dict, that the driver reads back (events.from_record). A record
        the queue does not take within its deadline is dropped (one warning): a metrics record after
        EMIT_TIMEOUT_S, one the driver's result is made of (MUST_REACH_DRIVER) after MUST_EMIT_TIMEOUT_S."""
        self._note_progress(event)
        if self._queue is None or (self.rank != 0 and not isinstance(event, events.Failure)):
            return
        must = isinstance(event, MUST_REACH_DRIVER)
        error = send_record(self._queue, event.to_record(), MUST_EMIT_TIMEOUT_S if must else EMIT_TIMEOUT_S)
        if error is None:
            return
        if must:  # each one named: the driver's summary will lack it
            logging.getLogger(__name__).warning(
                "the driver did not get the %r record of step %s: %s", event.kind, event.step, error
            )
        elif not self._emit_failed:
            logging.getLogger(__name__).warning("progress records no longer reach the driver (dropped): %s", error)
        self._emit_failed = True

    def _note_progress(self, event: events.RunEvent) -> None:
        """Rank 0 tells the control actor each step and commit: how it tells an attempt that made
        progress from a crash loop (control.py), even when the next one dies without a word."""
        if self._control is None or self.rank != 0 or isinstance(event, events.Failure):
            return
        committed = isinstance(event, (events.Checkpoint, events.MemoryCheckpoint))
        try:
            self._control.progress.remote(self.attempt, event.step, committed, isinstance(event, events.Start))
        except Exception:  # the driver is gone: nothing left to count for
            pass


EMIT_TIMEOUT_S = 5.0  # a metrics record waits this long for the driver's queue, then is dropped
MUST_EMIT_TIMEOUT_S = 60.0  # a record the driver's result is made of waits longer, then is named and dropped
# What the driver's result is made of, so worth a longer wait: why an attempt ended (Failure: a hang's
# or a crash's cause is named nowhere else), that the run stopped with a checkpoint (Stopped), the
# milestones it returns (Kept), the shards it skipped (Skipped), and the metrics of a run that had
# nothing left to train (Done). The others are metrics a later record supersedes.
MUST_REACH_DRIVER = (events.Failure, events.Stopped, events.Kept, events.Skipped, events.Done)


def send_record(queue, record: dict[str, Any], timeout_s: float) -> str | None:
    """Put ``record`` on the driver's Ray queue within ``timeout_s``; None, or why it did not go.

    Ray's ``Queue.put_nowait`` waits on its actor without a deadline (a hung or unreachable queue
    actor would hang the rank), so the call goes to the queue's actor directly, with one."""
    import ray

    try:
        ray.get(queue.actor.put_nowait.remote(record), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return f"the driver's queue took no record in {timeout_s:.0f} s"
    except Exception as e:  # the driver or its queue is gone
        return f"{type(e).__name__}: {str(e).strip()[:200]}"
    return None


def _preemption_context():
    """Ray Train's drain notice for this worker, read locally at every step (its public getter,
    ray.train.get_preemption_info, is a barrier across workers); None where Ray has none."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context
    except Exception:
        return None


def _answer(call, timeout_s: float):
    """The stream server's answer to ``call``. A server that died is restarted by Ray (empty) and
    answers once back; one that cannot be reached is a lost stream."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        return ray.get(call, timeout=timeout_s)
    except (RayActorError, GetTimeoutError) as e:
        raise DataStreamLost(f"the data stream server did not answer ({type(e).__name__}); {RESTART}") from None


def _process_started() -> float:
    import psutil  # a Ray dependency

    return psutil.Process().create_time()


def _already_stored(checkpoint, checkpoint_dir_name: str):
    """Every rank wrote its shards into the run folder itself: nothing to upload."""
    return checkpoint


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    # Progress reaches the driver through the monitor; Ray Data's per-execution lines are noise there.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    try:  # Ray Train names this logger by its file path, out of reach of LoggingConfig
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
    import ray

    # The config arrives redacted (Ray Train shows train_loop_config in its state API): each path
    # with a password or a signature in it reads "<redacted>" there, and the sealed storage
    # settings, whose credentials and real paths come from Ray's object store, open the real one.
    config = TrainConfig.from_dict(loop_config["config"])
    config.storage = loop_config["storage"]
    threads = max(1, int(config.cluster.cpus_per_worker))
    if not config.cluster.use_gpu:
        torch.set_num_threads(threads)
    control = loop_config["control"]
    session = RaySession(
        config,
        loop_config["queue"],
        loop_config["plans"],
        control,
        loop_config["validation"],
        loop_config["keepers"],
        loop_config["stream"],
    )
    limit = config.cluster.max_attempts_without_progress
    attempt = session.attempt = _begin_attempt(control, session.rank, session.world_size, limit)
    session.phases["attempt"] = time.time()
    if attempt == 1 and session.rank == 0 and session.memory_root:  # the nodes are up now (checkpoint/memory.py)
        check_memory_budget(model_shape(config.model).total, config.train, config.worker_range[1])
    trainer = None
    try:
        trainer = Trainer(config, session)
        trainer.fit()
    except RayllmError:
        raise  # no restart fixes it; rayllm's failure policy ends the run with it
    except BaseException as e:
        step = trainer.step if trainer is not None else -1
        # The step loop had begun once the attempt's data stream was open (train_batches).
        record = failure_record(e, step, in_loop="stream" in session.phases)
        repeated = ray.get(control.record_failure.remote(attempt, record), timeout=30)
        if repeated:
            message = f"rank {session.rank} failed the same way {record.where} on a fresh attempt: {record.cause}"
            session.emit(events.Failure(step=step, rank=session.rank, message=message, final=True))
            raise RayllmError(f"{message}. No restart fixes a deterministic error; fix its cause") from e
        session.emit(events.Failure(step=step, rank=session.rank, node=session.node, message=record.cause))
        raise


def _begin_attempt(control, rank: int, world_size: int, max_without_progress: int) -> int:
    """This attempt's number, the same on every rank (rank 0 counts it before the others read it);
    or the end of the run, when the attempts before it crashed in a loop (control.py)."""
    import ray
    import torch.distributed as dist

    if rank == 0:
        start = ray.get(control.begin_attempt.remote(max_without_progress, world_size), timeout=60)
        if start.stop:
            raise RayllmError(start.stop)
        attempt = start.attempt
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if rank != 0:
        attempt = ray.get(control.attempt.remote(), timeout=60)
    return attempt
