"""A checkpoint being written (stored or in memory): what is added beside the shards, and the
async write's futures; and a rank's record of the sequences it trained on, written beside them."""

from __future__ import annotations

import dataclasses
import io
import posixpath
from typing import Any

import numpy as np

from rayllm.checkpoint.state import TrainState
from rayllm.checkpoint.store import CheckpointStore


@dataclasses.dataclass
class PendingCheckpoint:
    """A checkpoint being written: what rank 0 adds beside the shards, and the write's futures."""

    step: int
    state: TrainState
    metrics: dict[str, Any]
    ids: np.ndarray | None
    final: bool = False
    copied: Any = None  # an async save's future: shards copied to CPU memory; None once waited for
    written: Any = None  # ... shards written; None once written
    stall_s: float = 0.0  # time the step loop spent on this checkpoint
    ids_uncommitted: np.ndarray | None = None  # in memory: the ids of a stored checkpoint still being written
    started: float = 0.0  # time.perf_counter() when the save began
    written_at: float | None = None  # ... when this rank's write ended (set by the writer's thread)


def write_ids(store: CheckpointStore, step: int, name: str, rank: int, ids: np.ndarray | None) -> None:
    """A rank's record of the sequence ids it trained on (data.record_ids), beside its shards."""
    if ids is not None:
        buffer = io.BytesIO()
        np.save(buffer, ids)
        store.fs.pipe_file(posixpath.join(store.path(step), f"{name}-rank{rank:05d}.npy"), buffer.getvalue())
