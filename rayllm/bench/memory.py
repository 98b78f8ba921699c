"""``rayllm bench memory``: stream a corpus several times larger than Ray's object store and
show that memory stays bounded.

The corpus is generated (so nothing is downloaded): jsonl shards of made-up prose, by
default 2 GB. Ray starts with its object store capped (default 500 MB), and rayllm's Ray
path (Ray Data tasks read, tokenize and pack; the global stream mixes, shuffles and cuts
batches) streams one pass over it while a sampler records, every half second, the resident
memory of this process and of every Ray process, and the object store's use. Bounded means
the peak does not grow as the stream goes on: the report gives the peak over the first
quarter of the stream next to the peak over the rest, and both next to the corpus size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SHARD_BYTES = 64 << 20
_SYLLABLES = "ka lo mi ne ru sa ti vo ze da fe gi hu ja ko le mu no pa qui re so tu va we xi yo zu".split()


def _vocabulary(rng: np.random.Generator, size: int = 4000) -> np.ndarray:
    words = {"".join(rng.choice(_SYLLABLES, size=rng.integers(1, 5))) for _ in range(size * 2)}
    return np.array(sorted(words)[:size])


def generate_corpus(root: Path, total_bytes: int, seed: int = 0) -> list[Path]:
    """jsonl shards of about SHARD_BYTES each, ``total_bytes`` in all; kept and reused when present."""
    root.mkdir(parents=True, exist_ok=True)
    marker = root / "_corpus.json"
    if marker.exists() and json.loads(marker.read_text()).get("bytes") == total_bytes:
        return sorted(root.glob("part-*.jsonl"))
    for old in root.glob("part-*.jsonl"):
        old.unlink()
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng)
    # Word frequencies fall off like natural text (Zipf), so the tokenizer sees common and rare words.
    p = 1.0 / np.arange(1, len(vocab) + 1)
    p /= p.sum()
    written, shard = 0, 0
    while written < total_bytes:
        path = root / f"part-{shard:05d}.jsonl"
        with open(path, "w") as f:
            size = 0
            while size < SHARD_BYTES and written + size < total_bytes:
                words = rng.choice(vocab, size=int(rng.integers(200, 3000)), p=p)
                line = json.dumps({"text": " ".join(words)}) + "\n"
                f.write(line)
                size += len(line)
        written += size
        shard += 1
    marker.write_text(json.dumps({"bytes": total_bytes}))
    return sorted(root.glob("part-*.jsonl"))


class MemorySampler:
    """Samples RSS of this process and of every Ray process, and the object store's use."""

    def __init__(self, interval: float = 0.5):
        self.samples: list[dict[str, float]] = []
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            ray_rss = 0
            for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
                try:
                    cmd = " ".join(proc.info["cmdline"] or [])
                    if proc.pid != me.pid and ("ray::" in cmd or "/ray/" in cmd or "raylet" in cmd):
                        ray_rss += proc.info["memory_info"].rss
                except (psutil.Error, TypeError):
                    continue
            self.samples.append(
                {
                    "t": time.perf_counter(),
                    "driver_rss": me.memory_info().rss,
                    "ray_rss": ray_rss,
                    "object_store_used": _object_store_used(),
                }
            )
            self._stop.wait(self._interval)


def _object_store_used() -> float:
    """Bytes in Ray's object store now, from Ray's own memory summary (``ray memory --stats-only``)."""
    import re

    from ray._private.internal_api import memory_summary

    try:
        found = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
    except Exception:
        return float("nan")
    return float(found.group(1)) * (1 << 20) if found else float("nan")


def run(config, cpus: int, gigabytes: float, object_store_mb: int, root: str) -> dict[str, Any]:
    from rayllm.data.discover import prepare_data
    from rayllm.data.order import DataState, open_stream
    from rayllm.data.stream.pipeline import configure_ray_data, ray_chunks

    started = time.perf_counter()
    shards = generate_corpus(Path(root), int(gigabytes * 1e9))
    generated = time.perf_counter() - started
    config.data.train = str(root)
    config.data.val = None
    config.data.demo_corpus = False
    config.data.tokenizer = None
    config.run.dir = str(Path(root) / "_run")  # the BPE trained on this corpus lives beside it, not in a real run
    plans = prepare_data(config, log=lambda *_: None)
    plan = dataclasses.replace(
        plans.train, sources=[dataclasses.replace(s, repeat=False, epochs_per_pass=1) for s in plans.train.sources]
    )
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(
        num_cpus=cpus,
        object_store_memory=object_store_mb << 20,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        logging_level="WARNING",
    )
    configure_ray_data()
    chunks = ray_chunks(tokenize_tasks=cpus, cpus_per_task=1.0, env={"RAYON_NUM_THREADS": "1"})
    rows, marks = 0, []
    with MemorySampler() as sampler:
        start = time.perf_counter()
        for batch, _ in open_stream(
            plan, DataState(), consumed=0, global_batch=config.train.global_batch_size, chunks=chunks
        ):
            rows += len(batch)
            marks.append(time.perf_counter())
        seconds = time.perf_counter() - start
    ray.shutdown()
    quarter = marks[len(marks) // 4] if marks else start
    early = [s for s in sampler.samples if s["t"] <= quarter]
    late = [s for s in sampler.samples if s["t"] > quarter]

    def peak(samples, key):
        return max((s[key] for s in samples), default=0.0)

    def total(s):
        return s["driver_rss"] + s["ray_rss"]

    corpus_bytes = sum(p.stat().st_size for p in shards)
    return {
        "corpus_bytes": corpus_bytes,
        "shards": len(shards),
        "generate_seconds": generated,
        "object_store_bytes": object_store_mb << 20,
        "cpus": cpus,
        "tokens": rows * (config.data.seq_len + 1),
        "seconds": seconds,
        "peak_driver_rss": peak(sampler.samples, "driver_rss"),
        "peak_total_rss_first_quarter": max((total(s) for s in early), default=0.0),
        "peak_total_rss_rest": max((total(s) for s in late), default=0.0),
        "peak_object_store_used": peak(sampler.samples, "object_store_used"),
        "samples": len(sampler.samples),
    }


def format_result(r: dict[str, Any]) -> str:
    gb = 1e9
    peak = max(r["peak_total_rss_first_quarter"], r["peak_total_rss_rest"])
    growth = r["peak_total_rss_rest"] / max(r["peak_total_rss_first_quarter"], 1.0)
    return "\n".join(
        [
            f"[rayllm bench memory] {r['corpus_bytes'] / gb:.2f} GB of text in {r['shards']} shards, object store "
            f"capped at {r['object_store_bytes'] / gb:.2f} GB, {r['cpus']} CPU(s)",
            f"  streamed {r['tokens']:,} tokens in {r['seconds']:.0f} s ({r['tokens'] / r['seconds']:,.0f} tokens/s)",
            f"  peak RSS, this process               {r['peak_driver_rss'] / gb:8.2f} GB",
            f"  peak RSS, all processes, 1st quarter {r['peak_total_rss_first_quarter'] / gb:8.2f} GB",
            f"  peak RSS, all processes, the rest    {r['peak_total_rss_rest'] / gb:8.2f} GB"
            f"  (x{growth:.2f} of the first quarter's)",
            f"  peak object store use                {r['peak_object_store_used'] / gb:8.2f} GB",
            f"  corpus / object store                {r['corpus_bytes'] / r['object_store_bytes']:8.1f}x",
            f"  corpus / peak RSS                    {r['corpus_bytes'] / max(peak, 1.0):8.1f}x",
        ]
    )
