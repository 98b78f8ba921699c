"""Perplexity of a trained model over held-out shards, spread over Ray workers.

Each shard is scored whole by one worker: its documents are tokenized, joined with EOS as
training packs them, and cut into windows of ``seq_len + 1`` tokens, each predicting its last
``seq_len``. The summed negative log-likelihoods and token counts of all shards give the
perplexity, so the figure does not depend on the number of workers. Ray Data runs the
workers (an actor pool, one model each) over the list of shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from rayllm.data.shards import iter_documents, iter_token_documents
from rayllm.errors import DataError
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import expand_shards
from rayllm.use.pretrained import Pretrained, load_checkpoint


@dataclass
class EvalResult:
    loss: float  # mean negative log-likelihood per predicted token, in nats
    perplexity: float
    tokens: int  # predicted tokens
    shards: int
    workers: int
    per_shard: list[dict] = field(default_factory=list)


def shard_tokens(pretrained: Pretrained, uri: str, text_field: str, storage: StorageSettings) -> np.ndarray:
    """The shard's documents as one stream of ids, each document followed by EOS."""
    eos = pretrained.eos_id
    token_docs = iter_token_documents(uri, storage)
    if token_docs is None:
        texts = list(iter_documents(uri, text_field, storage))
        token_docs = (e.ids for e in pretrained.tokenizer.encode_batch(texts, add_special_tokens=False))
    stream: list[int] = []
    for ids in token_docs:
        stream.extend(ids)
        stream.append(eos)
    return np.asarray(stream, dtype=np.int64)


@torch.no_grad()
def score_tokens(model, stream: np.ndarray, seq_len: int, batch_size: int = 8) -> tuple[float, int]:
    """(summed NLL, predicted tokens) of ``stream`` in windows of seq_len + 1 (the last one shorter)."""
    device = next(model.parameters()).device
    starts = list(range(0, max(len(stream) - 1, 0), seq_len))
    total, count = 0.0, 0
    full = [s for s in starts if s + seq_len + 1 <= len(stream)]
    for i in range(0, len(full), batch_size):
        rows = torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in full[i : i + batch_size]]))
        rows = rows.to(device)
        logits = model(rows[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    for s in starts[len(full) :]:  # the tail, shorter than a window
        row = torch.from_numpy(stream[s:]).to(device)[None]
        logits = model(row[:, :-1])
        total += F.cross_entropy(logits.float()[0], row[0, 1:], reduction="sum").item()
        count += row.shape[1] - 1
    return total, count


def score_shard(pretrained: Pretrained, uri: str, seq_len: int, text_field: str, storage: StorageSettings) -> dict:
    nll, count = score_tokens(pretrained.model, shard_tokens(pretrained, uri, text_field, storage), seq_len)
    return {"shard": uri, "nll": nll, "tokens": count}


class ShardScorer:
    """Ray Data actor: loads the model once, then scores the shards it is handed."""

    def __init__(self, checkpoint: str, seq_len: int | None, text_field: str, storage: StorageSettings, threads: int):
        torch.set_num_threads(threads)
        self.storage = storage
        self.pretrained = load_checkpoint(checkpoint, storage=self.storage, device="auto")
        self.seq_len = seq_len or self.pretrained.args.max_seq_len
        self.text_field = text_field

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [
            score_shard(self.pretrained, str(u), self.seq_len, self.text_field, self.storage) for u in batch["shard"]
        ]
        return {key: np.asarray([r[key] for r in rows]) for key in ("shard", "nll", "tokens")}


def summarize(rows: list[dict], workers: int) -> EvalResult:
    nll = sum(float(r["nll"]) for r in rows)
    tokens = sum(int(r["tokens"]) for r in rows)
    if tokens == 0:
        raise DataError("the evaluation data holds no tokens to predict; give shards with text in them")
    loss = nll / tokens
    return EvalResult(loss, math.exp(loss), tokens, len(rows), workers, sorted(rows, key=lambda r: r["shard"]))


def evaluate(
    checkpoint: str,
    data: str | list[str],
    *,
    workers: int = 2,
    seq_len: int | None = None,
    text_field: str = "text",
    storage: StorageSettings | None = None,
    cpus_per_worker: float = 1.0,
    use_gpu: bool = False,
) -> EvalResult:
    """Perplexity of ``checkpoint`` over the shards ``data`` names, on up to ``workers`` Ray actors."""

    import ray

    from rayllm.checkpoint import find_checkpoint
    from rayllm.ray_cluster import connect_ray

    storage = storage or StorageSettings()
    shards = expand_shards(data, storage, "evaluation data")
    checkpoint = find_checkpoint(checkpoint, storage)  # fail here, not inside every actor
    connect_ray(None, workers * cpus_per_worker + 1)  # the workers, and a CPU for Ray Data's tasks
    pool = min(workers, len(shards))
    scored = (
        ray.data.from_items([{"shard": s} for s in shards], override_num_blocks=len(shards))
        .map_batches(
            ShardScorer,
            fn_constructor_kwargs={
                "checkpoint": checkpoint,
                "seq_len": seq_len,
                "text_field": text_field,
                "storage": storage.sealed(),  # credentials travel only as a Ray object
                "threads": max(1, int(cpus_per_worker)),
            },
            batch_size=1,
            concurrency=pool,
            num_cpus=cpus_per_worker,
            num_gpus=1 if use_gpu else 0,
        )
        .take_all()
    )
    return summarize(scored, pool)


def evaluate_local(
    checkpoint: str | Pretrained,
    data: str | list[str],
    *,
    seq_len: int | None = None,
    text_field: str = "text",
    storage: StorageSettings | None = None,
) -> EvalResult:
    """The same figure in this process, without Ray: the reference the distributed one must equal."""
    storage = storage or StorageSettings()
    pretrained = checkpoint if isinstance(checkpoint, Pretrained) else load_checkpoint(checkpoint, storage=storage)
    shards = expand_shards(data, storage, "evaluation data")
    length = seq_len or pretrained.args.max_seq_len
    return summarize([score_shard(pretrained, s, length, text_field, storage) for s in shards], 1)


def format_result(result: EvalResult) -> str:
    return (
        f"[rayllm eval] {result.shards} shard(s) on {result.workers} worker(s): "
        f"{result.tokens:,} tokens, loss {result.loss:.4f}, perplexity {result.perplexity:.3f}"
    )
