"""``rayllm bench data``: the whole data pipeline's tokens/s against raw ``encode_batch``.

Both sides see the same text: every shard of ``data.train`` once. The baseline runs
``tokenizers`` ``encode_batch`` in one process on one thread (RAYON_NUM_THREADS=1, set
before the library starts its pool, hence a subprocess) and, for reference, on all
threads. The pipeline is rayllm's own Ray path: Ray Data tasks read, tokenize and pack,
and the global stream mixes, shuffles and cuts global batches, consumed here as fast as
it comes. The ratio per core is (pipeline tokens/s / CPUs) / (one-thread tokens/s), with the
pipeline's task workers warmed up first (as in a running job). It is given for the steady
state (packed rows arriving from the first chunk to the last: what a long run sees) and
with the start-up included (tasks launched, first shuffle window filled).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from rayllm.config import TrainConfig
from rayllm.data.discover import prepare_data
from rayllm.data.encode import JOB_DOCS
from rayllm.data.order import DataState, StreamSpec, open_stream

_RAW_SCRIPT = r"""
import itertools, json, sys, time
from tokenizers import Tokenizer
from rayllm.io.settings import StorageSettings
from rayllm.data.shards import iter_documents
args = json.loads(sys.stdin.read())
storage = StorageSettings(**args["storage"])
docs = [t for uri in args["shards"] for t in iter_documents(uri, args["text_field"], storage)] * args["epochs"]
tokenizer = Tokenizer.from_str(args["tokenizer_json"])
start = time.perf_counter()
tokens = 0
for i in range(0, len(docs), args["group"]):
    tokens += sum(len(e.ids) for e in tokenizer.encode_batch(docs[i : i + args["group"]], add_special_tokens=False))
seconds = time.perf_counter() - start
print(json.dumps({"tokens": tokens, "seconds": seconds, "chars": sum(map(len, docs)), "docs": len(docs)}))
"""


def raw_encode(plan: StreamSpec, threads: int | None, epochs: int, processes: int = 1) -> dict[str, Any]:
    """encode_batch over every training document, in a fresh process with ``threads`` tokenizer threads;
    with ``processes`` > 1, that many such processes at once (each on all the text), tokens/s summed."""
    src = plan.sources[0]
    args = {
        "shards": [u for s in plan.sources for u in s.shards],
        "text_field": src.text_field,
        "storage": dataclasses.asdict(src.storage),
        "tokenizer_json": src.tokenizer_json,
        "group": JOB_DOCS,
        "epochs": epochs,
    }
    env = dict(os.environ)
    if threads:
        env["RAYON_NUM_THREADS"] = str(threads)
    else:
        env.pop("RAYON_NUM_THREADS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RAW_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.stdin.write(json.dumps(args))
        proc.stdin.close()
    results = []
    for proc in procs:
        out = proc.stdout.read()
        if proc.wait() != 0:
            raise RuntimeError(f"the raw encode_batch baseline failed (exit {proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    first = results[0]
    return {**first, "tokens_per_s": sum(r["tokens"] / r["seconds"] for r in results)}


def pipeline(plan: StreamSpec, cpus: int, global_batch: int, epochs: int) -> dict[str, Any]:
    """The Ray path over ``epochs`` epochs of every source, consumed as fast as it is produced."""
    from rayllm.data.stream.pipeline import configure_ray_data, ray_chunks

    configure_ray_data()
    # The shard list repeated ``epochs`` times, read as one pass: the same text as the baseline.
    one_pass = dataclasses.replace(
        plan,
        sources=[
            dataclasses.replace(
                s,
                shards=s.shards * epochs,
                sizes=(s.sizes or [1] * len(s.shards)) * epochs,
                repeat=False,
                epochs_per_pass=1,
            )
            for s in plan.sources
        ],
    )
    produce = ray_chunks(tokenize_tasks=cpus, cpus_per_task=1.0, env={"RAYON_NUM_THREADS": "1"})
    arrivals = []  # (seconds, tokens) of each chunk of packed rows as it reaches this process

    def chunks(source, cursor):
        for chunk in produce(source, cursor):
            arrivals.append((time.perf_counter() - start, int(np.asarray(chunk["tokens"]).size)))
            yield chunk

    start = time.perf_counter()
    first = None
    rows = 0
    for batch, _ in open_stream(one_pass, DataState(), consumed=0, global_batch=global_batch, chunks=chunks):
        if first is None:
            first = time.perf_counter() - start
        rows += len(batch)
    seconds = time.perf_counter() - start
    seq = plan.sources[0].seq_len + 1
    # Steady state: from the first chunk's arrival to the last's, i.e. without the start-up (tasks
    # launched, first block made) that a long job pays once, but with everything else.
    span = arrivals[-1][0] - arrivals[0][0]
    return {
        "tokens": rows * seq,
        "seconds": seconds,
        "seconds_to_first_batch": first,
        "steady_tokens_per_s": sum(n for _, n in arrivals[1:]) / max(span, 1e-9),
    }


def run(config: TrainConfig, cpus: int, epochs: int = 5, repeats: int = 2) -> dict[str, Any]:
    """Each measurement ``repeats`` times, interleaved, keeping the best: a shared machine's
    speed drifts by 10-20% from minute to minute, and the best run is the least disturbed."""
    plans = prepare_data(config, log=lambda *_: None)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=cpus, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="WARNING")
    # Warm-up: start the task workers and load their tokenizers, as a running job already has.
    warm = dataclasses.replace(
        plans.train, sources=[dataclasses.replace(s, shards=s.shards[:cpus]) for s in plans.train.sources]
    )
    pipeline(warm, cpus, config.train.global_batch_size, 1)
    ones, manys, sides, pipes = [], [], [], []
    for _ in range(max(1, repeats)):
        ones.append(raw_encode(plans.train, threads=1, epochs=epochs))
        pipes.append(pipeline(plans.train, cpus, config.train.global_batch_size, epochs))
        manys.append(raw_encode(plans.train, threads=None, epochs=epochs))
        sides.append(raw_encode(plans.train, threads=1, epochs=epochs, processes=cpus))
    one, many, side_by_side = (max(runs, key=lambda r: r["tokens_per_s"]) for runs in (ones, manys, sides))
    pipe = max(pipes, key=lambda r: r["steady_tokens_per_s"])
    one_tps = one["tokens_per_s"]
    pipe_tps = pipe["tokens"] / pipe["seconds"]
    return {
        "cpus": cpus,
        "text_mb": one["chars"] / 1e6,
        "documents": one["docs"],
        "raw_tokens": one["tokens"],
        "raw_1_thread_tokens_per_s": one_tps,
        "raw_all_threads_tokens_per_s": many["tokens_per_s"],
        "raw_processes_tokens_per_s": side_by_side["tokens_per_s"],
        "pipeline_tokens": pipe["tokens"],
        "pipeline_tokens_per_s": pipe_tps,
        "pipeline_steady_tokens_per_s": pipe["steady_tokens_per_s"],
        "pipeline_seconds_to_first_batch": pipe["seconds_to_first_batch"],
        "ratio_per_core": pipe["steady_tokens_per_s"] / cpus / one_tps,
        "ratio_per_core_with_start": pipe_tps / cpus / one_tps,
        # What N busy cores give raw encode_batch on this machine (shared caches, memory bandwidth).
        "machine_ratio_per_core": side_by_side["tokens_per_s"] / cpus / one_tps,
    }


def format_result(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"[rayllm bench data] {r['text_mb']:.1f} MB of text ({r['documents']} documents), {r['cpus']} CPU(s)",
            f"  raw encode_batch, 1 thread      {r['raw_1_thread_tokens_per_s']:>12,.0f} tokens/s",
            f"  raw encode_batch, all threads   {r['raw_all_threads_tokens_per_s']:>12,.0f} tokens/s",
            f"  raw encode_batch, {r['cpus']} processes  {r['raw_processes_tokens_per_s']:>12,.0f} tokens/s"
            f"  (1 thread each, at once)",
            f"  rayllm pipeline, {r['cpus']} CPU(s), steady {r['pipeline_steady_tokens_per_s']:>12,.0f} tokens/s",
            f"  rayllm pipeline, with start-up  {r['pipeline_tokens_per_s']:>12,.0f} tokens/s"
            f"  (first batch after {r['pipeline_seconds_to_first_batch']:.1f} s)",
            f"  ratio per core, steady          {r['ratio_per_core']:>12.2f}  (goal >= 0.8)",
            f"  ratio per core, with start-up   {r['ratio_per_core_with_start']:>12.2f}",
            f"  raw processes' ratio per core   {r['machine_ratio_per_core']:>12.2f}  (this machine's own ceiling)",
            f"  pipeline / that ceiling         {r['ratio_per_core'] / r['machine_ratio_per_core']:>12.2f}",
        ]
    )
