"""The loop's numbers: a loss as a plain value, sums over ranks, and the window of steps between logs.

Per step: ``with window.waiting(): next batch``, then ``add(loss, grad_norm)``; at a log step
``summary(...)`` on every rank (one all-gather); ``start()`` once that step's validation and
checkpoint are done (their time is not step time).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from rayllm.config import TrainConfig
from rayllm.hardware import peak_resident_bytes

if TYPE_CHECKING:
    from rayllm.loop.session import Session


@dataclass(frozen=True)
class PeakFlops:
    """MFU's denominators, every rank's together. ``published``: the GPU's datasheet dense bf16
    peak, where the GPU is known and trains in bf16: the field's convention (papers, torchtitan),
    so MFU compares across reports. ``measured``: what this machine's matmuls reach, measured at
    the start (on an H100 roughly 75-80% of the published): the second figure, and the only one
    on a CPU."""

    measured: float
    published: float | None = None

    @property
    def basis(self) -> float:
        return self.published or self.measured


def plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (loss_parallel's is a replicated DTensor)."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Collective: ``values`` summed over all ranks (float64; no collective on a single rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def per_rank(values: list[float], device: torch.device) -> np.ndarray:
    """Collective: every rank's ``values``, one row per rank in rank order (float64; no
    collective on a single rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t)
        t = torch.stack(gathered)
    return t.reshape(-1, len(values)).cpu().numpy()


def all_nodes(node: str) -> list[str]:
    """Collective: every rank's node name, in rank order (no collective on a single rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [node]
    nodes: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    return nodes


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """The window's memory metrics. CUDA: the most the tensors held, the most the caching
    allocator reserved (what the GPU really gave up: nvidia-smi's figure less the context), and
    how often it had to free its cache and retry (a sign of fragmentation or a near-OOM);
    elsewhere the process's peak resident memory alone."""
    if device.type != "cuda":
        return {"peak_memory_bytes": peak_resident_bytes(), "peak_reserved_bytes": None, "alloc_retries": None}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def mixture(sources: Sequence[str], counts: np.ndarray) -> dict[str, float]:
    """The realised share of each source among ``counts`` sequences (one count per source)."""
    whole = max(1, int(counts.sum()))
    return {name: int(n) / whole for name, n in zip(sources, counts, strict=True)}


class MetricWindow:
    """The steps since the last log line of one rank, and the metrics they make.

    ``waiting`` and ``add`` (local) once per step; ``summary`` (collective: one all-gather
    of each rank's loss, waits, clock and source counts, so every rank calls it at the same steps) makes the logged
    metrics and empties the window; ``start`` restarts its clock (it starts with the window).

    Of the session it reads the world size, the device and the training sources' names; MFU is
    against ``peaks.basis`` (and ``mfu_measured`` against the measured matmul peak), the
    mixture counts ``counts_before`` (all ranks', before this attempt) in.
    """

    def __init__(
        self,
        config: TrainConfig,
        session: Session,
        flops_per_token: float,
        peaks: PeakFlops,
        restarts: int,
        counts_before: np.ndarray,
    ):
        self.tokens_per_step = config.train.global_batch_size * config.data.seq_len
        self.flops_per_token, self.peaks, self.restarts = flops_per_token, peaks, restarts
        self.world_size, self.device = session.world_size, session.device
        self.sources = [source.name for source in session.train_spec.sources]
        self.counts_before = counts_before
        self.loss, self.steps, self.wait = 0.0, 0, 0.0
        self.grad_norm = math.nan  # the last step's
        self.start()

    def start(self) -> None:
        """The window's clock starts (again)."""
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait for data: its seconds count as the step's data wait."""
        started = time.perf_counter()
        yield
        self.wait += time.perf_counter() - started

    def add(self, loss: float, grad_norm: float, finite: bool = True) -> None:
        """One step: its loss (a skipped, non-finite step's is kept out of the mean, though the step
        counts) and its gradient norm."""
        self.loss += loss if finite else 0.0
        self.grad_norm = grad_norm
        self.steps += 1

    def summary(
        self, *, step: int, lr: float, tokens: int, skipped_shards: int, counts: np.ndarray, collective_frac: float
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Collective: (the metrics of the window, the realised mixture so far); ``counts`` (per source) are
        this rank's this attempt, ``collective_frac`` the part of its window spent in collectives
        (sampled by the watchdog). Empties the window (its clock restarts with ``start``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.started
        # One collective for every rank's loss, data wait, end-of-step wait, clock and source counts.
        rows = per_rank([self.loss, self.wait, collective_frac * elapsed, elapsed, *counts], self.device)
        loss_sum, summed = float(rows[:, 0].sum()), rows[:, 4:].sum(axis=0)
        waits = rows[:, 1].tolist()  # the slowest-fed rank is named, not averaged away
        own = np.maximum(0.0, rows[:, 3] - rows[:, 1] - rows[:, 2]) / self.steps  # each rank's step less its waits
        shares = mixture(self.sources, self.counts_before + np.asarray(summed, dtype=np.int64))
        tps = self.tokens_per_step * self.steps / elapsed
        mean_loss = loss_sum / self.world_size / self.steps
        metrics = {
            "step": step,
            "loss": mean_loss,
            "perplexity": math.exp(min(mean_loss, 50.0)),
            "lr": lr,
            "grad_norm": self.grad_norm,
            "tokens": tokens,
            "tokens_per_s": tps,
            "tokens_per_s_per_worker": tps / self.world_size,
            "flops_per_s": tps * self.flops_per_token,
            "mfu": tps * self.flops_per_token / self.peaks.basis,
            "mfu_measured": tps * self.flops_per_token / self.peaks.measured,
            "step_time_s": elapsed / self.steps,
            "data_wait_frac": sum(waits) / len(waits) / elapsed,
            "data_wait_max_frac": max(waits) / elapsed,
            "data_wait_max_rank": int(np.argmax(waits)),
            "rank_own_step_s": own.tolist(),
            "rank_data_wait_s": (rows[:, 1] / self.steps).tolist(),
            "rank_collective_wait_s": (rows[:, 2] / self.steps).tolist(),
            **peak_memory(self.device),
            "world_size": self.world_size,
            "restarts": self.restarts,
            "skipped_shards": skipped_shards,
        }
        self.loss, self.steps, self.wait = 0.0, 0, 0.0
        return metrics, shares
