"""The loop's checkpoints: written in the background, committed once every rank's part is stored.

    save(step)  -> every rank starts writing its shards at the checkpoint's URI (async: the loop
                   waits only for the copy to CPU memory, before the next optimizer step)
    commit()    -> at the first step every rank's write is done (agreed in the loop's control
                   all-reduce): rank 0's state, a barrier, the commit marker (store.py), the
                   session's registration, then rank 0's housekeeping in a thread of its own

    save_memory(step) -> the same into the keepers' object store (checkpoint/memory.py), marked
                   by rank 0 in the background once written (memory_saver.py), unregistered, the
                   latest one kept; resume takes the newest whole checkpoint

    agree()     -> once a step, one small all-reduce: whether a write is still running on some
                   rank, whether a time-based checkpoint is due, and the loop's own stop flags

One component for both sessions (Ray Train and torchrun); they differ only in ``register``.
It owns its two gloo groups and the typed train state it writes (state.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import posixpath
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rayllm import checkpoint, events
from rayllm.checkpoint import memory
from rayllm.checkpoint.lease import lease_owner_id, require_owner
from rayllm.checkpoint.memory_saver import MemorySaver, wait_copied
from rayllm.checkpoint.pending import PendingCheckpoint, write_ids
from rayllm.checkpoint.state import TrainState
from rayllm.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class StepAgreement:
    """What every rank agreed on after a step (Checkpointer.agree), so that all act at the same step."""

    writing: bool  # some rank's part of the pending checkpoint is still being written
    stop: bool  # a stop was requested (SIGTERM, SIGINT, ray job stop)
    checkpoint_due: bool  # train.checkpoint_every_s has passed since the last commit
    preempted_rank: int | None  # a rank asked to stop on its own (a reclaimed node), or None


class Checkpointer:
    """Checkpoints of one rank, collective: every rank constructs it at the same point.

    It creates three gloo groups of its own. ``group`` is for the async writer's collectives, which
    run in a background thread and must not interleave with the loop's; ``memory_group`` the same
    for the in-memory writer, which may write beside it. ``loop_group`` is used only from the
    loop's thread: the step agreement and the commit's barrier, which may run while a stored one
    is still writing (a barrier on ``group`` then met the writer's all-gather on the other rank,
    and both waited for ever)."""

    def __init__(
        self,
        config: TrainConfig,
        session,
        device: torch.device,
        tokenizer_json: str | None,
        before_commit: Callable[[int, int, int], None] = lambda step, rank, world: None,
        slow: Callable[[float, str], AbstractContextManager] = lambda seconds, phase: contextlib.nullcontext(),
    ):
        self.config, self.session, self.device = config, session, device
        self.tokenizer_json = tokenizer_json  # the run's, written beside every stored checkpoint
        # Made whenever a process group exists, even of one rank: the async writer's collectives
        # must never run on the default group (NCCL on a GPU) beside the training loop's.
        groups = [dist.new_group(backend="gloo") for _ in range(3)] if dist.is_initialized() else [None] * 3
        self.loop_group, self.group, memory_group = groups
        self._collective = dist.is_initialized() and session.world_size > 1  # else nothing to agree with
        self.before_commit = before_commit  # (step, rank, world): the tests' crash between write and commit
        self.slow = slow  # (deadline, phase): the hang watchdog's long phase, for the end of the run
        self.store = checkpoint.CheckpointStore(config.run.dir, config.storage)
        self.pending: PendingCheckpoint | None = None
        self._writer: checkpoint.AsyncWriter | None = None
        self.last_at = time.monotonic()
        self.committed_step: int | None = None  # of the latest stored checkpoint committed
        self.memory: checkpoint.CheckpointStore | None = None
        self._memory_saver: MemorySaver | None = None
        if session.memory_root:
            memory.register()
            self.memory = checkpoint.CheckpointStore(session.memory_root, config.storage)
            background = config.train.async_checkpoint
            self._memory_saver = MemorySaver(self.memory, config.storage, session, device, memory_group, background)
        # Rank 0 copies milestones and prunes old checkpoints off the step loop: removing a
        # checkpoint's files takes as long as a small model's step.
        self._tidier = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayllm-tidy") if session.rank == 0 else None
        )
        self.owner: str | None = None  # the run dir's lease holder (lease.py), written into each marker
        if session.rank == 0:
            self.owner = lease_owner_id(config.run.dir, config.storage)
            if self._memory_saver is not None:
                self._memory_saver.owner = self.owner
            self._tidier.submit(self._finish_milestones)  # copies an earlier attempt's end cut off

    def agree(self, stop_requested: bool, preempted: bool) -> StepAgreement:
        """Collective, once a step: one small all-reduce on the loop's group."""
        every_s = self.config.train.checkpoint_every_s
        due = bool(every_s) and time.monotonic() - self.last_at >= every_s and self.session.rank == 0
        preempt = self.session.rank + 1 if preempted else 0
        flags = torch.tensor([self.writing(), stop_requested, due, preempt], dtype=torch.int32)
        if self._collective:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.loop_group)
        writing, stop, due, preempt = flags.tolist()
        return StepAgreement(bool(writing), bool(stop), bool(due), preempt - 1 if preempt else None)

    # -- resume ----------------------------------------------------------------------------
    def latest(self) -> str | None:
        return self.store.latest()

    def newest(self) -> str | None:
        """Collective: where to resume: the newest in-memory checkpoint when it is at least as new
        as the latest stored one and whole on the surviving nodes (the object store is read
        faster than storage), else the latest stored one. Rank 0 decides for all: the keepers'
        answers may change while ranks ask."""
        choice = [None]
        if self.session.rank == 0:
            stored = self.store.complete_steps()
            choice[0] = self.store.latest(on_incomplete=self._warn)
            resumed = -1  # the in-memory checkpoint resumed from, if any
            for step in reversed(self.memory.complete_steps() if self.memory else []):
                if stored and step < stored[-1]:
                    break
                if memory.whole(self.memory.uri(step)):
                    choice[0], resumed = self.memory.uri(step), step
                    break
            if self.memory is not None:  # the rest is older, not whole or stale: no save rewrites one
                self.memory.keep_only(resumed)
        if self._collective:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        return choice[0]

    def is_memory(self, uri: str) -> bool:
        return uri.startswith(f"{memory.PROTOCOL}://")

    def ids_since_stored(self, uri: str, state: TrainState) -> list[np.ndarray]:
        """After resuming from memory: the ids trained on since the last committed stored
        checkpoint, which the next stored one records: those of a stored checkpoint that was
        being written unless it got committed after all, then the later ones. This rank takes
        those of old ranks rank, rank + world, ..."""
        rank, world = self.session.rank, self.session.world_size
        names = ["consumed-rank{:05d}.npy"]
        if state.ids_uncommitted_step not in (None, *self.store.complete_steps()):
            names.insert(0, "uncommitted-rank{:05d}.npy")
        folder, found = self.memory.fs._strip_protocol(uri), []
        for old in range(rank, state.world_size, world):
            for name in names:
                path = posixpath.join(folder, name.format(old))
                if self.memory.fs.exists(path):
                    found.append(np.load(io.BytesIO(self.memory.fs.cat_file(path))))
        return [ids for ids in found if len(ids)]  # an empty record has no fields to join with the rest

    def restore(self, uri: str, model, optimizer) -> TrainState:
        """Collective: model and optimizer from the complete checkpoint ``uri``; returns its state."""
        checkpoint.require_complete(uri, self.config.storage)
        checkpoint.load(uri, self.config.storage, model, optimizer)
        return checkpoint.read_state(uri, self.config.storage)

    # -- save ------------------------------------------------------------------------------
    def save_step(
        self,
        state: TrainState,
        metrics: dict[str, Any],
        ids: np.ndarray | None,
        model,
        optimizer,
        *,
        final: bool,
        in_memory: bool = False,
    ) -> None:
        """Collective: checkpoint this step to storage (save) or into the keepers (save_memory).
        ``ids``: the sequences this rank trained on since the last stored checkpoint (data.record_ids)."""
        ckpt = PendingCheckpoint(state.step, state, dict(metrics), ids, final=final)
        if not in_memory:
            self.save(ckpt, model, optimizer)
            return
        uncommitted = self.pending  # a stored checkpoint still being written: its ids are held here too
        if ids is not None and uncommitted is not None:
            ckpt.ids_uncommitted = uncommitted.ids
            state.ids_uncommitted_step = uncommitted.step
        self.save_memory(ckpt, model, optimizer)

    def save(self, ckpt: PendingCheckpoint, model, optimizer) -> None:
        """Collective: checkpoint this step. Async unless final or train.async_checkpoint is off."""
        started = time.perf_counter()
        if self.pending is not None:  # one write at a time: finish the previous one first
            self.commit(self.pending)
        uri = self.store.uri(ckpt.step)
        storage = self.config.storage
        if self.session.rank == 0:  # a re-save of a step: no longer a checkpoint before any rank writes
            self._require_run_dir(f"writing the checkpoint of step {ckpt.step}")
            self.store.unmark(ckpt.step)  # (DCP's save plans collectively, with rank 0, before writing)
        if self.config.train.async_checkpoint and not ckpt.final:
            if self._writer is None:
                self._writer = checkpoint.AsyncWriter(self.device, self.group)
            ckpt.copied, ckpt.written = self._writer.save(uri, storage, model, optimizer)
            ckpt.stall_s = time.perf_counter() - started
            self.pending = ckpt
        else:
            checkpoint.save(uri, storage, model, optimizer)
            ckpt.stall_s = time.perf_counter() - started
            self.commit(ckpt)

    def save_memory(self, ckpt: PendingCheckpoint, model, optimizer) -> None:
        """Collective: start this step's in-memory checkpoint, written and marked off the loop
        (memory_saver.py). Ray Train does not register it; only the latest one is kept."""
        self._memory_saver.save(ckpt, model, optimizer)

    @property
    def memory_save_s(self) -> float | None:
        """The last in-memory save's time on this rank, from its start to its write's end."""
        return self._memory_saver.save_s if self._memory_saver else None

    def wait_copied(self) -> None:
        """Before the weights change: wait until pending async saves have copied them (their stall)."""
        wait_copied(self.pending)
        if self._memory_saver is not None:
            self._memory_saver.wait_copied()

    def writing(self) -> bool:
        """Whether this rank's part of the pending checkpoint is still being written."""
        return self.pending is not None and self.pending.written is not None and not self.pending.written.done()

    def commit(self, ckpt: PendingCheckpoint) -> None:
        """Collective: once every rank's part is stored, rank 0 marks the checkpoint complete."""
        started = time.perf_counter()
        rank, world = self.session.rank, self.session.world_size
        wait_copied(ckpt)
        if ckpt.written is not None:
            ckpt.written.result()
            ckpt.written = None
        if rank == 0:  # rank 0's part, stored before the others may be: only the marker makes it count
            self.store.write_state(ckpt.step, ckpt.state, self.tokenizer_json)
        self.before_commit(ckpt.step, rank, world)
        write_ids(self.store, ckpt.step, "consumed", rank, ckpt.ids)
        if self._collective:
            dist.barrier(group=self.group)  # every rank's part is stored
        if rank == 0:
            self._require_run_dir(f"committing the checkpoint of step {ckpt.step}")
            self.store.mark_complete(ckpt.step, world, owner=self.owner)
        self.session.register(ckpt.step, ckpt.metrics, self.store.uri(ckpt.step))
        ckpt.stall_s += time.perf_counter() - started
        if self.pending is ckpt:
            self.pending = None
        self.last_at = time.monotonic()
        self.committed_step = ckpt.step
        if rank == 0:
            self._tidier.submit(self._tidy, ckpt.step)
            self.session.emit(events.Checkpoint(step=ckpt.step, stall_s=ckpt.stall_s, final=ckpt.final))

    def _require_run_dir(self, doing: str) -> None:
        """Rank 0: the run dir is still this run's (lease.py), else RunDirTaken ends the run (a
        rayllm error: rank 0's alone ends every rank's attempt, no restart)."""
        if self.owner is not None:
            require_owner(self.config.run.dir, self.config.storage, self.owner, doing)

    def _tidy(self, step: int) -> None:
        """Rank 0, in the background and in commit order: keep a milestone's copy, drop old checkpoints."""
        t = self.config.train
        try:
            if checkpoint.is_milestone(step, t.keep_checkpoint_every):
                self.session.emit(events.Kept(step=step, uri=self.store.keep_milestone(step)))
            if self.session.prunes_checkpoints:
                self.store.prune(t.keep_checkpoints, written_before=step)
            else:  # Ray Train keeps the last K it was told of; writes that never finished are ours
                self.store.prune_unfinished(written_before=step)
        except Exception as e:  # housekeeping must never stop training; the next commit tries again
            self.session.emit(events.RunWarning(step=step, message=f"checkpoint housekeeping: {e}"))

    def _finish_milestones(self) -> None:
        """Rank 0, in the background at start: milestone copies an earlier attempt's end cut off."""
        try:
            for uri in self.store.finish_milestones(self.config.train.keep_checkpoint_every):
                self.session.emit(events.Kept(step=int(uri.rstrip("/").rsplit("_", 1)[1]), uri=uri))
        except Exception as e:
            self._warn(f"finishing the milestone copies: {e}")

    def _warn(self, message: str) -> None:
        self.session.emit(events.RunWarning(step=self.committed_step or 0, message=message))

    def close(self) -> None:
        """Commit what is pending and let housekeeping finish (a milestone copy: hundreds of GB at
        70B), inside the watchdog's long phase with its own deadline: not a hang, but bounded. A
        copy cut off there is finished at the next start (_finish_milestones)."""
        with self.slow(self.config.train.close_timeout_s, "the end of the run (last commit, milestone copy)"):
            if self.pending is not None:
                self.commit(self.pending)
            if self._memory_saver is not None:
                self._memory_saver.close()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._tidier is not None:
                self._tidier.shutdown(wait=True)
