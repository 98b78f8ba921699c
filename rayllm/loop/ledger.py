"""What a rank has trained on: sequences per source, and (with data.record_ids) their ids.

The counts give the realised mixture; the ids go into the next stored checkpoint, so that the
committed checkpoints together name every sequence trained on, each once. One rank of each
tensor-parallel group keeps them: its peers train on the same rows.
"""

from __future__ import annotations

import numpy as np
import torch

from rayllm.checkpoint.state import TrainState
from rayllm.data.source import ID_FIELDS
from rayllm.loop.metrics import all_sum


class DataLedger:
    def __init__(self, num_sources: int, keeps: bool, record_ids: bool):
        self.keeps, self.record_ids = keeps, record_ids
        self.counts = np.zeros(num_sources, dtype=np.int64)  # this rank's, this attempt
        self.counts_before = np.zeros_like(self.counts)  # all ranks', before this attempt
        self._ids: list[np.ndarray] = []  # since the last stored checkpoint

    def record(self, rows: np.ndarray) -> None:
        if not self.keeps:
            return
        if self.record_ids:
            self._ids.append(rows[list(ID_FIELDS)].copy())
        self.counts += np.bincount(rows["source"], minlength=len(self.counts))

    def restore(self, state: TrainState, ids_since_stored: list[np.ndarray] | None) -> None:
        if len(state.source_counts) == len(self.counts):
            self.counts_before = np.asarray(state.source_counts, dtype=np.int64)
        if ids_since_stored is not None and self.record_ids and self.keeps:
            self._ids = ids_since_stored

    def totals(self, device: torch.device) -> list[int]:
        """Collective: every rank's counts and the earlier attempts', per source."""
        counts = all_sum([float(c) for c in self.counts], device)
        return [int(b + c) for b, c in zip(self.counts_before, counts, strict=True)]

    def take_ids(self, in_memory: bool) -> np.ndarray | None:
        """The ids since the last stored checkpoint, for the checkpoint being written (None when this
        rank records none). A stored checkpoint takes them; an in-memory one holds a copy, so the
        next stored checkpoint still gets them after a resume from memory."""
        if not (self.record_ids and self.keeps):
            return None
        ids = np.concatenate(self._ids) if self._ids else np.empty(0)
        self._ids = [ids] if in_memory and len(ids) else []  # (an empty one has no fields)
        return ids
