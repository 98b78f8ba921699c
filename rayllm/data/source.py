"""One shard as a stream of packed sequences: documents -> tokens -> blocks.

Every sequence has a stable id (source, epoch, shard, index) and a place it starts
(document, token offset): restarting a shard there reads it up to that document,
tokenizes from there on, and nothing else. Which shards are read together, and in what
order, is shard_groups.py's business.

The functions here are plain Python: Ray Data runs them in its tasks and the torchrun
path in-process, so both produce identical rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from rayllm.data import tokenizer as tok
from rayllm.data.encode import InProcess, TokenizePool, read_ahead
from rayllm.data.packing import pack
from rayllm.data.shards import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    DROP_REASONS,
    Dropped,
    ReadLimits,
    iter_documents,
    iter_token_documents,
)
from rayllm.errors import DataError
from rayllm.io.settings import StorageSettings

ID_FIELDS = ("source", "epoch", "shard", "index")
SLOT_CURSOR_FIELDS = ("index", "doc", "doc_token")  # where a shard restarts


@dataclass
class SourceSpec:
    """All a task needs to rebuild one source's stream; small and picklable."""

    name: str
    shards: list[str]
    weight: float
    text_field: str
    storage: StorageSettings
    tokenizer_json: str
    seq_len: int
    seed: int
    index: int = 0  # this source's place in the mixture
    shuffle: bool = True
    repeat: bool = True  # epochs without end (training) or a single pass (validation)
    epochs_per_pass: int = 1  # epochs handed to one Ray Data execution
    on_bad_shard: str = "error"
    mix: int = 1  # shards read at once and interleaved (data.mix_shards)
    sizes: list[int] | None = None  # bytes per shard, from the listing: how the interleave paces them
    # Seeds the shard order (default: ``index``); a resume keeps a source's key when others are
    # removed or reordered, so its saved cursor still names the same shards (fingerprint.align).
    shard_order_key: int | None = None

    @property
    def order_key(self) -> int:
        return self.index if self.shard_order_key is None else self.shard_order_key

    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES  # data.max_document_bytes

    @property
    def limits(self) -> ReadLimits:
        return ReadLimits(self.max_document_bytes, skip_too_long=self.on_bad_shard == "skip")


def shard_visit(source: int, epoch: int, shard: int, cursor: tuple[int, int, int] | None = None) -> dict[str, int]:
    """One visit of a shard; with ``cursor`` (the last sequence already taken from it), the visit
    restarts at that sequence's start and drops it."""
    entry = {"source": source, "epoch": epoch, "shard": shard}
    if cursor is None:
        return {**entry, "index": 0, "doc": 0, "doc_token": 0, "drop_through": -1}
    index, doc, doc_token = cursor
    return {**entry, "index": index, "doc": doc, "doc_token": doc_token, "drop_through": index}


class ShardPacker:
    """Tokenizes and packs one shard visit at a time (inside a group's task); with a ``pool``,
    the tokenizing runs in Ray tasks sized to the run (encode.py)."""

    def __init__(self, plan: SourceSpec, pool: TokenizePool | None = None):
        self.plan, self.pool = plan, pool
        self.tokenizer = tok.load(plan.tokenizer_json, "of this run")
        self.eos = tok.eos_id(self.tokenizer)

    def _documents(self, uri: str, first_doc: int, dropped: Dropped) -> Iterator[tuple[int, list[int]]]:
        """(document index, token ids) from ``first_doc`` on; earlier documents are read, not tokenized.
        The records left out of the whole shard, those before ``first_doc`` too, are counted in ``dropped``."""
        pre = iter_token_documents(uri, self.plan.storage, self.plan.limits, dropped)
        if pre is not None:  # a pre-tokenised shard (rayllm prepare): no tokenizer needed
            yield from itertools.islice(enumerate(pre), first_doc, None)
            return
        texts = iter_documents(uri, self.plan.text_field, self.plan.storage, self.plan.limits, dropped)
        docs = itertools.islice(enumerate(texts), first_doc, None)
        yield from read_ahead(docs, self.pool or InProcess(), self._encode_here)

    def _encode_here(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def rows(self, item: dict[str, int], chunk: int = 256) -> Iterator[dict[str, np.ndarray]]:
        """The visit's rows; then, where records were left out, a marker row counting them (once the
        whole shard is read, so a visit restarted mid-shard counts the same)."""
        uri = self.plan.shards[item["shard"]]
        start = int(item["index"])
        dropped = Dropped()
        try:
            documents = self._documents(uri, int(item["doc"]), dropped)
            for blocks, docs, offsets in pack(
                documents, self.eos, self.plan.seq_len + 1, chunk=chunk, first_offset=item["doc_token"]
            ):
                n = len(blocks)
                index = np.arange(start, start + n, dtype=np.int64)
                start += n
                keep = index > item["drop_through"]
                if keep.any():
                    yield _columns(item, blocks[keep], index[keep], docs[keep], offsets[keep])
        except DataError as e:
            if self.plan.on_bad_shard != "skip":
                raise
            yield _marker(item, self.plan.seq_len + 1, f"{e}", dropped)
            return
        if dropped.total():
            yield _marker(item, self.plan.seq_len + 1, "", dropped)


def _columns(item, blocks, index, docs, offsets, error: str = "", dropped: Dropped | None = None) -> dict:
    n = len(blocks)
    counts = np.zeros((n, len(DROP_REASONS)), dtype=np.int64)
    if dropped is not None:
        counts[:] = [dropped.counts[r] for r in DROP_REASONS]
    return {
        "tokens": blocks,
        "source": np.full(n, item["source"], dtype=np.int32),
        "epoch": np.full(n, item["epoch"], dtype=np.int32),
        "shard": np.full(n, item["shard"], dtype=np.int32),
        "index": index,
        "doc": docs,
        "doc_token": offsets,
        "error": np.array([error] * n, dtype=object),
        "dropped": counts,  # per DROP_REASONS: records of the shard left out (marker rows only)
    }


def _marker(item, block: int, message: str, dropped: Dropped) -> dict[str, np.ndarray]:
    """One row with index -1 that tells the stream a shard was skipped (``message``: why) or that
    records of it were left out (``dropped``)."""
    one = np.zeros((1, block), dtype=np.int32)
    return _columns(item, one, np.array([-1]), np.array([0]), np.array([0]), error=message, dropped=dropped)


RECORD_DTYPE_FIELDS = [
    ("source", np.int32),
    ("epoch", np.int32),
    ("shard", np.int32),
    ("index", np.int64),
    ("doc", np.int64),
    ("doc_token", np.int64),
    ("group", np.int64),
    ("slot", np.int32),
]


def to_records(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, list[dict], list[dict]]:
    """Columns to one structured array (tokens + id + cursor per row), the shards skipped, and the
    shard visits that left records out ({"source", "epoch", "shard", "dropped": {reason: count}}).

    One array keeps each sequence's id attached through mixing, shuffling and rank slicing.
    """
    tokens = np.asarray(batch["tokens"])
    marker = np.asarray(batch["index"]) < 0
    skipped, dropped = [], []
    for i in np.flatnonzero(marker):
        visit = {"source": int(batch["source"][i]), "epoch": int(batch["epoch"][i]), "shard": int(batch["shard"][i])}
        if str(batch["error"][i]):
            skipped.append({**visit, "error": str(batch["error"][i])})
        counts = np.asarray(batch["dropped"][i])
        if counts.any():
            dropped.append({**visit, "dropped": {r: int(c) for r, c in zip(DROP_REASONS, counts, strict=True) if c}})
    keep = ~marker
    dtype = [("tokens", np.int32, tokens.shape[1:]), *RECORD_DTYPE_FIELDS]
    rows = np.empty(int(keep.sum()), dtype=dtype)
    rows["tokens"] = tokens[keep]
    for name, _ in RECORD_DTYPE_FIELDS:
        rows[name] = np.asarray(batch[name])[keep]
    return rows, skipped, dropped
