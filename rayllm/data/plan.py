"""Driver-side data preparation: find shards, fix the tokenizer, check there is data.

Runs before any worker starts, so a missing path, an unreadable first shard or an empty
dataset fails in seconds with a message instead of inside a worker.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from rayllm.config import TrainConfig
from rayllm.data import tokenizer as tok
from rayllm.data.demo_corpus import ensure_demo_corpus, is_demo_path
from rayllm.data.pipeline import StreamPlan
from rayllm.data.shards import iter_documents
from rayllm.errors import DataError
from rayllm.storage import expand_shards, filesystem, join, read_text, write_text

TOKENIZER_FILE = "tokenizer.json"
SAMPLE_CHAR_LIMIT = 20_000_000


@dataclass
class DataPlans:
    train: StreamPlan
    val: StreamPlan | None
    tokenizer_uri: str
    vocab_size: int


def prepare_data(config: TrainConfig, log=print) -> DataPlans:
    d, storage = config.data, config.data.storage
    _ensure_demo(config, log)
    train_shards = expand_shards(d.train, storage, "data.train")
    val_shards = expand_shards(d.val, storage, "data.val") if d.val else []
    sample = _sample_documents(train_shards, d.text_field, storage, d.tokenizer_sample_docs)
    if not sample:
        raise DataError(
            f"data.train is empty: its {len(train_shards)} shard(s) hold no non-empty "
            f"{d.text_field!r} documents. Point data.train at shards with text"
        )
    tokenizer_json, tokenizer_uri = _tokenizer(config, sample, log)
    tokenizer = tok.load(tokenizer_json, tokenizer_uri)
    tok.eos_id(tokenizer)
    vocab = tokenizer.get_vocab_size()
    if vocab > config.model.vocab_size:
        raise DataError(
            f"the tokenizer has {vocab} tokens but model.vocab_size is {config.model.vocab_size}; "
            f"set model.vocab_size to at least {vocab}"
        )
    sample_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(sample[:256], add_special_tokens=False))
    if sample_tokens < d.seq_len + 1 and len(sample) < d.tokenizer_sample_docs:
        raise DataError(
            f"data.train holds about {sample_tokens} tokens, fewer than one sequence of data.seq_len + 1 = "
            f"{d.seq_len + 1}; add data or lower data.seq_len"
        )
    epochs = _epochs_to_list(config, train_shards, sample, sample_tokens)
    common = dict(text_field=d.text_field, storage=storage, tokenizer_json=tokenizer_json, seq_len=d.seq_len)
    train = StreamPlan(shards=train_shards, seed=config.train.seed, epochs=epochs, **common)
    val = StreamPlan(shards=val_shards, seed=0, epochs=1, shuffle=False, **common) if val_shards else None
    return DataPlans(train=train, val=val, tokenizer_uri=tokenizer_uri, vocab_size=vocab)


def _ensure_demo(config: TrainConfig, log) -> None:
    d = config.data
    if d.demo_corpus and (is_demo_path(d.train) or is_demo_path(d.val)) and ensure_demo_corpus():
        log("prepared the demo corpus (Python standard library source) in data/demo")


def train_tokenizer(
    config: TrainConfig, output: str, vocab_size: int | None = None, special_tokens: list[str] | None = None
) -> dict:
    """Train a byte-level BPE on a sample streamed from ``data.train`` and save it at ``output``."""
    d = config.data
    _ensure_demo(config, print)
    shards = expand_shards(d.train, d.storage, "data.train")
    sample = _sample_documents(shards, d.text_field, d.storage, d.tokenizer_sample_docs)
    if not sample:
        raise DataError(f"data.train holds no non-empty {d.text_field!r} documents to train a tokenizer on")
    vocab = vocab_size or config.model.vocab_size
    tokenizer = tok.train_bpe(sample, vocab, special_tokens)
    write_text(output, tokenizer.to_str(), d.storage)
    return {"output": output, "vocab_size": tokenizer.get_vocab_size(), "documents": len(sample), "shards": len(shards)}


def _sample_documents(shards: list[str], text_field: str, storage, limit: int) -> list[str]:
    """Up to ``limit`` documents taken round-robin from the shards (reads only what it keeps)."""
    per_shard = max(1, math.ceil(limit / len(shards)))
    sample: list[str] = []
    chars = 0
    for uri in shards:
        for text in itertools.islice(iter_documents(uri, text_field, storage), per_shard):
            sample.append(text)
            chars += len(text)
        if len(sample) >= limit or chars >= SAMPLE_CHAR_LIMIT:
            break
    return sample


def _tokenizer(config: TrainConfig, sample: list[str], log) -> tuple[str, str]:
    """The tokenizer JSON and where it is kept: the user's file, the run's own, or a new BPE."""
    storage = config.data.storage
    if config.data.tokenizer:
        text = read_text(config.data.tokenizer, storage)
        if text is None:
            raise DataError(f"data.tokenizer {config.data.tokenizer!r} does not exist; give a tokenizer.json path")
        return text, config.data.tokenizer
    run_copy = join(config.run.dir, TOKENIZER_FILE)
    text = read_text(run_copy, storage)
    if text is not None:
        return text, run_copy
    log(f"training a byte-level BPE tokenizer (vocab {config.model.vocab_size}) on {len(sample)} documents")
    tokenizer = tok.train_bpe(sample, config.model.vocab_size)
    text = tokenizer.to_str()
    write_text(run_copy, text, storage)
    return text, run_copy


def _epochs_to_list(config: TrainConfig, shards: list[str], sample: list[str], sample_tokens: int) -> int:
    """Epochs the stream lists so it outlasts training, estimated from bytes per token."""
    sample_chars = sum(len(t) for t in sample[:256]) or 1
    chars_per_token = sample_chars / max(1, sample_tokens)
    total_bytes = 0
    for uri in shards:
        fs, path = filesystem(uri, config.data.storage)
        total_bytes += fs.size(path) or 0
    tokens_per_epoch = max(1.0, total_bytes / chars_per_token)
    needed = config.train.max_steps * config.train.global_batch_size * (config.data.seq_len + 1)
    return max(1, math.ceil(needed / tokens_per_epoch) + 1)
