"""What the benchmarks share: a rank's device and process group for a bench, a Session that
holds only what the Trainer's step needs, synthetic batches shaped like the data stream's, and
timed steps of the product's own ``Trainer``."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import types
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayllm.config import TrainConfig
from rayllm.data.source import RECORD_DTYPE_FIELDS
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import is_remote, join, read_text
from rayllm.parallel.process_group import local_device


def read_records(run_dir: str, kind: str | None = None, storage: StorageSettings | None = None) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records in order (stamped by the driver as they arrive), only those of
    ``kind`` if given; a last line still being written is left for the next read. On object storage
    (``storage`` given) the file is as the driver last flushed it."""
    if is_remote(str(run_dir)):
        text = read_text(join(run_dir, "metrics.jsonl"), storage or StorageSettings()) or ""
    else:
        try:
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                text = f.read()
        except FileNotFoundError:
            return []
    records = [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]
    return records if kind is None else [r for r in records if r.get("kind") == kind]


def train_in_thread(config: TrainConfig) -> tuple[threading.Thread, dict[str, Any], threading.Event]:
    """``rayllm.train(config)`` in a daemon thread, so that a benchmark can act on the run meanwhile:
    (the thread, a box that receives ``result`` or ``error``, an event set when it has ended)."""
    from rayllm.runtime.launch import train

    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["result"] = train(config, quiet=True)
        except BaseException as e:  # the benchmark reports it
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box, done


def bench_device(config: TrainConfig, rank: int = 0) -> torch.device:
    """Rank ``rank``'s device in a one-machine bench (made current on a GPU)."""
    local = rank % max(torch.cuda.device_count(), 1) if config.cluster.use_gpu else None
    return local_device(config.cluster.use_gpu, local)


def release_models(device: torch.device) -> None:
    """Free what models built in this process held, before processes of their own start on the
    same GPU: compiled blocks' guards keep their modules alive until dynamo's caches go, and
    the caching allocator keeps freed blocks reserved for this process until emptied."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_rows(config: TrainConfig, n: int, seed: int = 0) -> np.ndarray:
    """``n`` rows shaped like the data stream's (tokens plus ids), random tokens."""
    seq = config.data.seq_len + 1
    rows = np.zeros(n, dtype=[("tokens", np.int32, (seq,)), *RECORD_DTYPE_FIELDS])
    rows["tokens"] = np.random.default_rng(seed).integers(0, config.model.vocab_size, size=(n, seq))
    rows["index"] = np.arange(n)
    return rows


class StepSession:
    """The Session for a Trainer that only steps (no data stream, checkpoints or metrics)."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.local_world_size = world_size
        self.node, self.attempt = "bench", 1
        self.phases: dict[str, float] = {}
        self.stream_kept = None
        self.train_spec = types.SimpleNamespace(sources=[None])  # one source: all the ledger counts
        self.val_spec = None
        self.prunes_checkpoints, self.memory_root = False, None


def bench_trainer(config: TrainConfig, rank: int, world_size: int, device: torch.device):
    from rayllm.loop.trainer import Trainer

    return Trainer(config, StepSession(rank, world_size, device))


def timed_steps(trainer, rows: np.ndarray, steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Collective: ``steps`` of the Trainer's step on the same rows, each timed alone; (losses, seconds)."""
    losses, times = [], []
    for _ in range(steps):
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        losses.append(trainer.train_step(rows)[0])
        sync(device)
        times.append(time.perf_counter() - start)
    return losses, times


def flash_attention_fits(config: TrainConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether SDPA's flash kernel takes this model's attention (head size, GQA, dtype, device)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = config.model
    head_dim = m.dim // m.n_heads
    q = torch.randn(1, m.n_heads, 128, head_dim, device=device, dtype=dtype)
    kv = torch.randn(1, m.n_kv_heads, 128, head_dim, device=device, dtype=dtype)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=m.n_kv_heads != m.n_heads)
        return True
    except RuntimeError:
        return False


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
