"""One data source as a stream of packed sequences: shards -> documents -> tokens -> blocks.

A source visits its shards epoch after epoch, each epoch in a permutation seeded by
(seed, source, epoch); each shard packs its documents into consecutive sequences.
Every sequence therefore has a stable id (source, epoch, shard, index) and a place it
starts (item, document, token offset): a *cursor*. Restarting a source at a cursor
reads the current shard up to that document, tokenizes from there on, and nothing else.

The functions here are plain Python: Ray Data runs ``pack_items`` in its tasks, and the
torchrun path calls ``local_chunks`` in-process, so both produce identical rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from rayllm.config import StorageSettings
from rayllm.data import tokenizer as tok
from rayllm.data.packing import pack
from rayllm.data.shards import iter_documents, iter_token_documents
from rayllm.errors import DataError

ENCODE_GROUP = 64  # documents per encode_batch call: enough to use tokenizers' threads
ID_FIELDS = ("source", "epoch", "shard", "index")
CURSOR_FIELDS = ("item", "index", "doc", "doc_token")


@dataclass
class SourcePlan:
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

    @property
    def items_per_epoch(self) -> int:
        return len(self.shards)


def shard_order(num_shards: int, seed: int, source: int, epoch: int, shuffle: bool = True) -> list[int]:
    if not shuffle:
        return list(range(num_shards))
    return [int(i) for i in np.random.default_rng([seed, source, epoch]).permutation(num_shards)]


def work_item(plan: SourcePlan, item: int, cursor: tuple[int, ...] | None = None) -> dict[str, int]:
    """Item ``item`` of the source's endless list of (epoch, shard) visits.

    With ``cursor`` (the last sequence already taken, inside this item), the item restarts
    at that sequence's start and drops it.
    """
    epoch, place = divmod(item, plan.items_per_epoch)
    shard = shard_order(plan.items_per_epoch, plan.seed, plan.index, epoch, plan.shuffle)[place]
    entry = {"source": plan.index, "item": item, "epoch": epoch, "shard": shard}
    if cursor is None:
        return {**entry, "index": 0, "doc": 0, "doc_token": 0, "drop_through": -1}
    _, index, doc, doc_token = cursor
    return {**entry, "index": index, "doc": doc, "doc_token": doc_token, "drop_through": index}


def items_from(plan: SourcePlan, first: int, cursor: tuple[int, ...] | None, count: int) -> list[dict[str, int]]:
    """``count`` items from item ``first`` (restarted at ``cursor`` when it lies in that item)."""
    end = first + count if plan.repeat else min(first + count, plan.items_per_epoch)
    return [work_item(plan, i, cursor if cursor and i == cursor[0] else None) for i in range(first, end)]


class ShardPacker:
    """Tokenizes and packs one work item at a time; the body of a Ray Data task."""

    def __init__(self, plan: SourcePlan):
        self.plan = plan
        self.tokenizer = tok.load(plan.tokenizer_json, "of this run")
        self.eos = tok.eos_id(self.tokenizer)

    def _documents(self, uri: str, first_doc: int, first_token: int) -> Iterator[tuple[int, list[int]]]:
        """(document index, token ids) from ``first_doc`` on; earlier documents are read, not tokenized."""
        pre = iter_token_documents(uri, self.plan.storage)
        if pre is not None:  # a pre-tokenised shard (rayllm prepare): no tokenizer needed
            yield from itertools.islice(enumerate(pre), first_doc, None)
            return
        docs = itertools.islice(
            enumerate(iter_documents(uri, self.plan.text_field, self.plan.storage)), first_doc, None
        )
        while group := list(itertools.islice(docs, ENCODE_GROUP)):
            encoded = self.tokenizer.encode_batch([text for _, text in group], add_special_tokens=False)
            for (doc, _), e in zip(group, encoded, strict=True):
                yield doc, e.ids

    def rows(self, item: dict[str, int]) -> Iterator[dict[str, np.ndarray]]:
        uri = self.plan.shards[item["shard"]]
        start = int(item["index"])
        try:
            documents = self._documents(uri, int(item["doc"]), int(item["doc_token"]))
            for blocks, docs, offsets in pack(
                documents, self.eos, self.plan.seq_len + 1, first_offset=item["doc_token"]
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
            yield _skip_marker(item, self.plan.seq_len + 1, f"{e}")

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(batch["item"])):
            yield from self.rows({k: int(v[i]) for k, v in batch.items()})


def _columns(item, blocks, index, docs, offsets, error: str = "") -> dict[str, np.ndarray]:
    n = len(blocks)
    return {
        "tokens": blocks,
        "source": np.full(n, item["source"], dtype=np.int32),
        "epoch": np.full(n, item["epoch"], dtype=np.int32),
        "shard": np.full(n, item["shard"], dtype=np.int32),
        "index": index,
        "item": np.full(n, item["item"], dtype=np.int64),
        "doc": docs,
        "doc_token": offsets,
        "error": np.array([error] * n, dtype=object),
    }


def _skip_marker(item, block: int, message: str) -> dict[str, np.ndarray]:
    """One row with index -1 that tells the stream a shard was skipped (and why)."""
    one = np.zeros((1, block), dtype=np.int32)
    return _columns(item, one, np.array([-1]), np.array([0]), np.array([0]), error=message)


RECORD_DTYPE_FIELDS = [
    ("source", np.int32),
    ("epoch", np.int32),
    ("shard", np.int32),
    ("index", np.int64),
    ("item", np.int64),
    ("doc", np.int64),
    ("doc_token", np.int64),
]


def to_records(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, list[dict]]:
    """Columns to one structured array (tokens + id + cursor per row) and the shards skipped.

    One array keeps each sequence's id attached through mixing, shuffling and rank slicing.
    """
    tokens = np.asarray(batch["tokens"])
    marker = np.asarray(batch["index"]) < 0
    skipped = [
        {
            "source": int(batch["source"][i]),
            "epoch": int(batch["epoch"][i]),
            "shard": int(batch["shard"][i]),
            "error": str(batch["error"][i]),
        }
        for i in np.flatnonzero(marker)
    ]
    keep = ~marker
    dtype = [("tokens", np.int32, tokens.shape[1:]), *RECORD_DTYPE_FIELDS]
    rows = np.empty(int(keep.sum()), dtype=dtype)
    rows["tokens"] = tokens[keep]
    for name, _ in RECORD_DTYPE_FIELDS:
        rows[name] = np.asarray(batch[name])[keep]
    return rows, skipped


def cursor_of(row: np.void) -> tuple[int, int, int, int]:
    return tuple(int(row[f]) for f in CURSOR_FIELDS)


def local_chunks(plan: SourcePlan, cursor: tuple[int, ...] | None) -> Iterator[dict[str, np.ndarray]]:
    """The source's stream from ``cursor`` without Ray: column batches, as Ray Data yields them."""
    packer = ShardPacker(plan)
    yield from passes(plan, cursor, lambda items: (batch for item in items for batch in packer.rows(item)))


def passes(
    plan: SourcePlan, cursor: tuple[int, ...] | None, run_pass: Callable[[list[dict]], Iterable[dict]]
) -> Iterator[dict[str, np.ndarray]]:
    """Run the source pass after pass (``epochs_per_pass`` epochs each) from the cursor on.

    A whole epoch that yields no sequence is an error rather than an endless loop.
    """
    first = cursor[0] if cursor else 0
    count = plan.epochs_per_pass * plan.items_per_epoch
    while True:
        items = items_from(plan, first, cursor, count)
        if not items:
            return
        produced = 0
        for batch in run_pass(items):
            produced += int((np.asarray(batch["index"]) >= 0).sum())
            yield batch
        if produced == 0 and cursor is None and plan.repeat:
            raise DataError(
                f"data source {plan.name!r} produced no sequences in a whole epoch: its documents hold fewer than "
                f"data.seq_len + 1 tokens in every shard (or every shard was skipped). Add data or lower data.seq_len"
            )
        if not plan.repeat:
            return
        first, cursor = items[-1]["item"] + 1, None
