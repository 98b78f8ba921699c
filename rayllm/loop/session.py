"""What the training loop needs from its environment: a Ray Train worker or a torchrun rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from rayllm.data.order import DataSlicing, DataState, StreamSpec
from rayllm.events import RunEvent


class Session(Protocol):
    """What the loop needs from its environment."""

    rank: int
    world_size: int
    local_world_size: int  # ranks on this rank's node
    device: torch.device
    node: str  # where this rank runs, as a person would name it (hang and straggler reports)
    attempt: int  # this attempt's number, 1 for the first
    # Wall-clock times at which this attempt's start-up stages ended, by stage ("process", "loop",
    # "attempt", "model", ...): the loop adds its own, and reports them with the first step
    # (``rayllm bench recovery``'s breakdown).
    phases: dict[str, float]
    stream_kept: bool | None  # whether this attempt's data came from a running stream; None: no such stream

    train_spec: StreamSpec
    val_spec: StreamSpec | None

    def train_batches(
        self, state: DataState, consumed: int, slicing: DataSlicing
    ) -> Iterator[tuple[np.ndarray, DataState]]:
        """This rank's rows of each global batch from ``consumed`` on, with the data state after each:
        slice ``slicing.slice_of(rank)`` of ``slicing.slices`` (TP peers and pipeline stages share one)."""

    prunes_checkpoints: bool  # whether rayllm deletes old checkpoints itself (Ray Train does its own)
    memory_root: str | None  # where in-memory checkpoints go (checkpoint/memory.py), None: none

    def peak_flops(self, measure: Callable[[], float]) -> float:
        """Collective: every rank's matmul peak together, ``measure()`` or what an earlier attempt of
        this world size measured (MFU's denominator)."""

    def validation_batches(self) -> list[np.ndarray]:
        """Collective: the whole global batches of validation data (train.val_batches of them, or
        fewer); each rank keeps its slice. Tokenized once per run: by the driver on Ray, by rank 0
        under torchrun."""

    def register(self, step: int, metrics: dict[str, Any], uri: str) -> None:
        """Collective: a complete checkpoint exists at ``uri`` (Ray Train records it for retention)."""

    def report(self, metrics: dict[str, Any]) -> None:
        """Collective: final metrics without a checkpoint."""

    def stop_requested(self) -> bool:
        """Whether a stop (SIGTERM, SIGINT) was asked for; the loop agrees on it across ranks."""

    def preempted(self) -> bool:
        """Whether this rank's process was asked to stop on its own (a reclaimed node): the run
        checkpoints at the step all ranks agree on, then restarts."""

    def emit(self, event: RunEvent) -> None:
        """Rank 0's events (rayllm/events.py) to the driver's monitor, and any rank's Failure."""
