"""In-memory checkpoints of one rank, written off the step loop.

    save(step)  -> rank 0's state and each rank's ids are put at once (small); DCP's async save
                   copies the shards to CPU memory while the next step runs (the loop waits for
                   the copy before the optimizer step) and hands them to the keepers in its thread
    marker      -> rank 0, in a thread of its own: DCP's write ends on rank 0 only after it has
                   gathered every rank's write result (and written .metadata), so once it ends
                   every part is held: the marker, then the earlier in-memory folders go. No
                   barrier in the loop: the checkpoint counts as soon as the last write ends.
    next save   -> waits for the last one's write and marker first (one at a time), which raises
                   its error, if any, in the loop

With ``background`` off (train.async_checkpoint: false) a save waits for its write and marker.

Nothing here re-saves a step over a marked folder: steps only grow within an attempt, and the
checkpointer drops every in-memory folder but the one it resumes from (``Checkpointer.newest``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rayllm import events
from rayllm.checkpoint.dcp_io import AsyncWriter
from rayllm.checkpoint.pending import PendingCheckpoint, write_ids
from rayllm.checkpoint.store import CheckpointStore
from rayllm.io.settings import StorageSettings


class MemorySaver:
    """One rank's in-memory saves; ``group``: a gloo group of its own for DCP's writer thread,
    which may write while the stored checkpoint's writer writes on another."""

    def __init__(
        self, store: CheckpointStore, storage: StorageSettings, session, device: torch.device, group, background: bool
    ):
        self.store, self.storage, self.session, self.background = store, storage, session, background
        self.owner: str | None = None  # the run dir's lease holder, written into each marker (rank 0)
        self._device, self._group = device, group
        self._writer: AsyncWriter | None = None
        self._marker = ThreadPoolExecutor(1, thread_name_prefix="rayllm-mem-mark") if session.rank == 0 else None
        self.pending: PendingCheckpoint | None = None
        self._marked: Future | None = None
        self.save_s: float | None = None  # the last save's time from its start to this rank's write's end

    def save(self, ckpt: PendingCheckpoint, model, optimizer) -> None:
        """Collective: start writing this step's in-memory checkpoint (see module doc)."""
        ckpt.started = time.perf_counter()
        self.finish()
        rank, step = self.session.rank, ckpt.step
        if rank == 0:
            self.store.write_state(step, ckpt.state, None)
        # Before DCP's collective planning: every rank's ids are held before rank 0's write can end.
        write_ids(self.store, step, "consumed", rank, ckpt.ids)
        write_ids(self.store, step, "uncommitted", rank, ckpt.ids_uncommitted)
        if self._writer is None:
            self._writer = AsyncWriter(self._device, self._group)
        ckpt.copied, ckpt.written = self._writer.save(self.store.uri(step), self.storage, model, optimizer)
        ckpt.written.add_done_callback(lambda _: setattr(ckpt, "written_at", time.perf_counter()))
        ckpt.stall_s = time.perf_counter() - ckpt.started
        self.pending = ckpt
        if self._marker is not None:
            self._marked = self._marker.submit(self._mark_when_written, ckpt)
        if not self.background:
            self.finish()

    def _mark_when_written(self, ckpt: PendingCheckpoint) -> None:
        """Rank 0's marker thread: once every rank's part is held, the marker; earlier folders go."""
        ckpt.written.result()  # raises the write's error here too: then no marker
        step = ckpt.step
        self.store.mark_complete(step, self.session.world_size, owner=self.owner)
        self.store.drop_before(step)  # a rank ahead may be writing the next one's ids already
        fs = self.store.fs
        held = fs.usage(self.store.root) if hasattr(fs, "usage") else fs.du(self.store.root)
        write_s = time.perf_counter() - ckpt.started
        stall_s = ckpt.stall_s if self.background else write_s  # written in the loop: it waited throughout
        self.session.emit(events.MemoryCheckpoint(step=step, stall_s=stall_s, nbytes=held, write_s=write_s))

    def wait_copied(self) -> None:
        """Before the weights change: the pending save's copy to CPU memory (its stall)."""
        wait_copied(self.pending)

    def finish(self) -> None:
        """Wait for the pending save's write (and on rank 0 its marker); raises their error."""
        ckpt, self.pending = self.pending, None
        if ckpt is None:
            return
        wait_copied(ckpt)
        ckpt.written.result()
        self.save_s = (ckpt.written_at or time.perf_counter()) - ckpt.started
        marked, self._marked = self._marked, None
        if marked is not None:
            marked.result()

    def close(self) -> None:
        """At the end of an attempt: the pending save finished and marked, the threads ended."""
        try:
            self.finish()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._marker is not None:
                self._marker.shutdown(wait=True)


def wait_copied(ckpt: PendingCheckpoint | None) -> None:
    """Wait until an async save has copied the weights to CPU memory, counted as its stall."""
    if ckpt is None or ckpt.copied is None:
        return
    started = time.perf_counter()
    ckpt.copied.result()
    ckpt.copied = None
    ckpt.stall_s += time.perf_counter() - started
