"""Driver-side data preparation: find shards, fix the tokenizer, check there is data.

Runs before any worker starts, so a missing path, an unreadable first shard or an empty
dataset fails in seconds with a message instead of inside a worker.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import posixpath
from dataclasses import dataclass

import numpy as np

from rayllm.config import SourceSettings, TrainConfig
from rayllm.data import tokenizer as tok
from rayllm.data.demo_corpus import ensure_demo_corpus, is_demo_path
from rayllm.data.order import StreamSpec
from rayllm.data.shard_groups import local_chunks
from rayllm.data.shards import ReadLimits, iter_documents, iter_token_documents
from rayllm.data.source import SourceSpec
from rayllm.errors import DataError
from rayllm.io.redact import display_uri
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import expand_shards, filesystem, join, list_shards, read_text, write_text

TOKENIZER_FILE = "tokenizer.json"
SHARD_TOKENIZER_FILE = "_tokenizer.json"  # beside pre-tokenised shards: the tokenizer that made them
SAMPLE_CHAR_LIMIT = 20_000_000
SAMPLE_SHARDS = 64  # shards the driver samples documents from, spread over the listing


@dataclass
class DataSpecs:
    train: StreamSpec
    val: StreamSpec | None
    tokenizer_uri: str
    vocab_size: int

    def with_storage(self, storage: StorageSettings) -> DataSpecs:
        """These plans reading through ``storage`` (a sealed copy, before they go to other processes),
        each path as shown (display_uri: no password, no signature): ``storage`` knows the real ones
        (StorageSettings.with_secret_paths(plans.paths()))."""

        def swap(plan: StreamSpec | None) -> StreamSpec | None:
            if plan is None:
                return None
            sources = [
                dataclasses.replace(s, storage=storage, shards=[display_uri(u) for u in s.shards]) for s in plan.sources
            ]
            return dataclasses.replace(plan, sources=sources)

        shown = display_uri(self.tokenizer_uri)
        return dataclasses.replace(self, train=swap(self.train), val=swap(self.val), tokenizer_uri=shown)

    def paths(self) -> list[str]:
        """Every path these plans read: each shard, and the tokenizer's."""
        plans = [p for p in (self.train, self.val) if p is not None]
        return [self.tokenizer_uri, *(u for p in plans for s in p.sources for u in s.shards)]


@dataclass
class _Source:
    name: str
    shards: list[str]
    sizes: list[int]  # bytes per shard, from the listing
    weight: float
    text_field: str
    pretokenized: bool = False  # parquet shards with a ``tokens`` column (rayllm prepare's tokenize)


def _sources(config: TrainConfig) -> list[_Source]:
    """data.train as named, weighted sources (a plain path or list is one source of weight 1)."""
    d = config.data
    specs = d.train if isinstance(d.train, list) and d.train and isinstance(d.train[0], SourceSettings) else None
    if specs is None:
        shards, sizes = _listed(d.train, config.storage, "data.train")
        return [_Source("train", shards, sizes, 1.0, d.text_field, _pretokenized(shards, config.storage))]
    sources, names = [], set()
    for i, spec in enumerate(specs):
        path = spec.path if isinstance(spec.path, str) else spec.path[0]
        # The last part of the path, without a query (a signed URL's signature is no name).
        bare = display_uri(path).split("?", 1)[0]
        name = spec.name or posixpath.basename(bare.rstrip("/").split("*")[0].rstrip("/")) or f"source{i}"
        if name in names:
            name = f"{name}-{i}"
        names.add(name)
        shards, sizes = _listed(spec.path, config.storage, f"data.train[{i}].path")
        text_field = spec.text_field or d.text_field
        sources.append(_Source(name, shards, sizes, spec.weight, text_field, _pretokenized(shards, config.storage)))
    return sources


def _listed(spec, storage, what: str) -> tuple[list[str], list[int]]:
    listed = list_shards(spec, storage, what)
    return [uri for uri, _ in listed], [size for _, size in listed]


def _pretokenized(shards: list[str], storage) -> bool:
    return iter_token_documents(shards[0], storage) is not None


def prepare_data(config: TrainConfig, log=print) -> DataSpecs:
    """Plan a resolved config's data streams (rayllm.config.resolve first), on the driver, before any
    worker starts."""
    d, storage = config.data, config.storage
    _ensure_demo(config, log)
    sources = _sources(config)
    val_shards = expand_shards(d.val, storage, "data.val") if d.val else []
    samples = []
    for src in sources:
        limit = max(1, math.ceil(d.tokenizer_sample_docs * src.weight / sum(s.weight for s in sources)))
        sample = _sample_documents(src.shards, src.text_field, storage, limit, src.pretokenized, _limits(d))
        if not sample:
            where = "data.train" if len(sources) == 1 else f"data source {src.name!r}"
            what = "token" if src.pretokenized else f"non-empty {src.text_field!r}"
            raise DataError(
                f"{where} is empty: its {len(src.shards)} shard(s) hold no {what} documents. Point it at shards with text"
            )
        samples.append(sample)
    text_sample = [t for src, sample in zip(sources, samples, strict=True) if not src.pretokenized for t in sample]
    tokenizer_json, tokenizer_uri = _tokenizer(config, text_sample, log, sources)
    tokenizer = tok.load(tokenizer_json, tokenizer_uri)
    tok.eos_id(tokenizer)
    vocab = tokenizer.get_vocab_size()
    if vocab > config.model.vocab_size:
        raise DataError(
            f"the tokenizer has {vocab} tokens but model.vocab_size is {config.model.vocab_size}; "
            f"set model.vocab_size to at least {vocab}"
        )
    total_weight = sum(s.weight for s in sources)
    plans = []
    for index, (src, sample) in enumerate(zip(sources, samples, strict=True)):
        if src.pretokenized:
            _check_token_ids(src, sample, vocab, tokenizer_uri)
            sample_tokens = sum(len(ids) for ids in sample[:256])
        else:
            sample_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(sample[:256], add_special_tokens=False))
        if sample_tokens < d.seq_len + 1 and len(sample) < d.tokenizer_sample_docs * src.weight / total_weight:
            raise DataError(
                f"data source {src.name!r} holds about {sample_tokens} tokens, fewer than one sequence of "
                f"data.seq_len + 1 = {d.seq_len + 1}; add data or lower data.seq_len"
            )
        share = src.weight / total_weight
        plans.append(
            SourceSpec(
                name=src.name,
                shards=src.shards,
                weight=src.weight,
                text_field=src.text_field,
                storage=storage,
                tokenizer_json=tokenizer_json,
                seq_len=d.seq_len,
                seed=config.train.seed,
                index=index,
                epochs_per_pass=_epochs_per_pass(config, src, sample, sample_tokens, share),
                on_bad_shard=d.on_bad_shard,
                mix=d.mix_shards,
                sizes=src.sizes,
                max_document_bytes=d.max_document_bytes,
            )
        )
    train = StreamSpec(sources=plans, window=d.shuffle_window, seed=config.train.seed)
    val = None
    if val_shards:
        val_source = SourceSpec(
            name="val",
            shards=val_shards,
            weight=1.0,
            text_field=d.text_field,
            storage=storage,
            tokenizer_json=tokenizer_json,
            seq_len=d.seq_len,
            seed=0,
            shuffle=False,
            repeat=False,
            on_bad_shard=d.on_bad_shard,
            max_document_bytes=d.max_document_bytes,
        )
        val = StreamSpec(sources=[val_source], window=d.shuffle_window, seed=0)
        _check_val_size(val_source, config.train.global_batch_size)
    return DataSpecs(train=train, val=val, tokenizer_uri=tokenizer_uri, vocab_size=vocab)


def _check_val_size(source: SourceSpec, global_batch: int) -> None:
    """Validation reads whole global batches: a set smaller than one gives no val loss, so refuse it here.

    Packs the set in-process (validation sets are small) and stops as soon as one global batch is there.
    """
    have = 0
    for chunk in local_chunks(source, None):
        have += int((np.asarray(chunk["index"]) >= 0).sum())  # index -1: a skipped shard's marker
        if have >= global_batch:
            return
    raise DataError(
        f"data.val holds {have} sequence(s) of data.seq_len + 1 = {source.seq_len + 1} tokens, fewer than one "
        f"global batch (train.global_batch_size = {global_batch}), so it would give no validation loss; add "
        "validation data, lower train.global_batch_size, or set data.val=null"
    )


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
    sources = _sources(config)
    total = sum(s.weight for s in sources)
    sample, shards = [], []
    for src in sources:
        if src.pretokenized:
            continue  # token ids, no text to learn from
        limit = max(1, math.ceil(d.tokenizer_sample_docs * src.weight / total))
        sample += _sample_documents(src.shards, src.text_field, config.storage, limit, limits=_limits(d))
        shards += src.shards
    if not sample:
        raise DataError(f"data.train holds no non-empty {d.text_field!r} documents to train a tokenizer on")
    vocab = vocab_size or config.model.vocab_size
    tokenizer = tok.train_bpe(sample, vocab, special_tokens)
    write_text(output, tokenizer.to_str(), config.storage)
    return {"output": output, "vocab_size": tokenizer.get_vocab_size(), "documents": len(sample), "shards": len(shards)}


def _limits(d) -> ReadLimits:
    return ReadLimits(d.max_document_bytes, skip_too_long=d.on_bad_shard == "skip")


def _sample_documents(
    shards: list[str],
    text_field: str,
    storage,
    limit: int,
    pretokenized: bool = False,
    limits: ReadLimits | None = None,
) -> list:
    """Up to ``limit`` documents (texts, or token id lists for pre-tokenised shards) taken
    round-robin from the shards (reads only what it keeps)."""
    # Shards spread over the listing first, then the rest only while the sample is short:
    # a corpus of 100,000 shards is sampled from a few, not opened file by file.
    spread = shards[:: max(1, len(shards) // SAMPLE_SHARDS)][:SAMPLE_SHARDS]
    chosen = set(spread)
    per_shard = max(1, math.ceil(limit / len(spread)))
    sample: list = []
    chars = 0
    for uri in itertools.chain(spread, (u for u in shards if u not in chosen)):
        documents = (iter_token_documents(uri, storage) if pretokenized else None) or iter_documents(
            uri, text_field, storage, limits
        )
        for doc in itertools.islice(documents, per_shard):
            sample.append(doc)
            chars += len(doc)
        if len(sample) >= limit or chars >= SAMPLE_CHAR_LIMIT:
            break
    return sample


def _tokenizer(config: TrainConfig, sample: list[str], log, sources: list[_Source] = ()) -> tuple[str, str]:
    """The tokenizer JSON and where it is kept: the user's file, the one beside pre-tokenised
    shards, the run's own, or a new BPE. The run dir keeps a copy, so a run is self-contained."""
    storage = config.storage
    run_copy = join(config.run.dir, TOKENIZER_FILE)
    found = _given_tokenizer(config, sources)
    if found is not None:
        # Only a first run's copy: on a resume, the copy changes only once the checkpoint's data
        # fingerprint has accepted the new tokenizer (keep_tokenizer_copy).
        if read_text(run_copy, storage) is None:
            write_text(run_copy, found[0], storage)
        return found
    text = read_text(run_copy, storage)
    if text is not None:
        return text, run_copy
    pretokenized = [s.name for s in sources if s.pretokenized]
    if pretokenized:
        raise DataError(
            f"data source {pretokenized[0]!r} is pre-tokenised (parquet with a 'tokens' column) but no tokenizer "
            f"came with it: set data.tokenizer to the tokenizer.json that made it (rayllm prepare's tokenize.tokenizer)"
        )
    log(f"training a byte-level BPE tokenizer (vocab {config.model.vocab_size}) on {len(sample)} documents")
    tokenizer = tok.train_bpe(sample, config.model.vocab_size)
    text = tokenizer.to_str()
    write_text(run_copy, text, storage)
    return text, run_copy


def keep_tokenizer_copy(config: TrainConfig, plans: DataSpecs) -> None:
    """The run dir's tokenizer copy (which a resume without data.tokenizer reads) made the run's own."""
    text = plans.train.sources[0].tokenizer_json
    run_copy = join(config.run.dir, TOKENIZER_FILE)
    if read_text(run_copy, config.storage) != text:
        write_text(run_copy, text, config.storage)


def _given_tokenizer(config: TrainConfig, sources) -> tuple[str, str] | None:
    """data.tokenizer, else the ``_tokenizer.json`` that rayllm prepare left beside pre-tokenised shards."""
    storage = config.storage
    if config.data.tokenizer:
        text = read_text(config.data.tokenizer, storage)
        if text is None:
            raise DataError(
                f"data.tokenizer {display_uri(config.data.tokenizer)!r} does not exist; give a tokenizer.json path"
            )
        return text, config.data.tokenizer
    for src in sources:
        if src.pretokenized:
            beside = posixpath.join(posixpath.dirname(src.shards[0]), SHARD_TOKENIZER_FILE)
            text = read_text(beside, storage)
            if text is not None:
                return text, beside
    return None


def _check_token_ids(src: _Source, sample: list[list[int]], vocab: int, tokenizer_uri: str) -> None:
    top = max(max(ids) for ids in sample)
    if top >= vocab:
        raise DataError(
            f"data source {src.name!r} holds token id {top} but the tokenizer {display_uri(tokenizer_uri)} has {vocab} tokens: "
            f"its shards were made with another tokenizer; set data.tokenizer to that one"
        )


def _epochs_per_pass(config: TrainConfig, src: _Source, sample: list, sample_tokens: int, share: float) -> int:
    """Epochs of a source handed to one Ray Data execution: about what training needs, estimated
    from bytes per token, so a run rarely pays for starting a second execution."""
    total_bytes = sum(src.sizes)
    if src.pretokenized:  # bytes per document from the first shard's row count, tokens per document sampled
        import pyarrow.parquet as pq

        fs, path = filesystem(src.shards[0], config.storage)
        with fs.open(path, "rb") as f:
            rows = pq.ParquetFile(f).metadata.num_rows
        bytes_per_token = (fs.size(path) or 1) / max(1, rows) / max(1.0, sample_tokens / max(1, len(sample[:256])))
    else:
        bytes_per_token = (sum(len(t) for t in sample[:256]) or 1) / max(1, sample_tokens)
    tokens_per_epoch = max(1.0, total_bytes / bytes_per_token)
    needed = share * config.train.max_steps * config.train.global_batch_size * (config.data.seq_len + 1)
    return max(1, min(100, math.ceil(needed / tokens_per_epoch) + 1))
