"""The read stage of the prepare job: one Ray Data task reads a shard whole and labels each of its
documents with the stage that removes it (``KEPT`` when none does), normalised, hashed and counted.

Document ids are stable: ``id = shard_index << 32 | document_index`` (``split_id`` undoes it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rayllm.data import tokenizer as tok
from rayllm.data.shards import iter_documents
from rayllm.errors import DataError
from rayllm.io.settings import StorageSettings
from rayllm.prepare import dedup
from rayllm.prepare.config import NormalizeSettings
from rayllm.prepare.normalize import normalize_text
from rayllm.prepare.quality import first_failed_filter

KEPT = ""
NORMALIZE_EMPTY = "normalize_empty"
BAD_SHARD = "bad_shard"
LABEL_CHUNK = 1000  # documents per labelled table a read task yields

LABELED_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("shard", pa.int32()),
        ("text", pa.string()),  # "" once removed: later stages never need it
        ("hash", pa.string()),
        ("raw_tokens", pa.int64()),  # in the text as read
        ("tokens", pa.int64()),  # in the normalised text
        ("removed_by", pa.string()),  # KEPT, NORMALIZE_EMPTY, BAD_SHARD or a filter's name
        ("error", pa.string()),  # why a shard is bad (its one BAD_SHARD row)
    ]
)


def document_id(shard: int, index: int) -> int:
    return shard << 32 | index


def split_id(doc_id: int) -> tuple[int, int]:
    """(shard index, document index) of a document id."""
    return doc_id >> 32, doc_id & 0xFFFFFFFF


@dataclass(frozen=True)
class LabelPlan:
    """All a read task needs; small and picklable."""

    text_field: str
    storage: StorageSettings
    normalize: NormalizeSettings
    thresholds: dict[str, float]
    tokenizer_json: str | None


@functools.lru_cache(maxsize=2)
def _tokenizer(tokenizer_json: str):
    return tok.load(tokenizer_json, "of this prepare job")


def count_tokens(texts: list[str], tokenizer_json: str | None) -> list[int]:
    """Tokens per text with the tokenizer, else whitespace-separated words."""
    if tokenizer_json is None:
        return [len(t.split()) for t in texts]
    return [len(e.ids) for e in _tokenizer(tokenizer_json).encode_batch(texts, add_special_tokens=False)]


def label_shards(batch: dict[str, np.ndarray], plan: LabelPlan) -> Iterator[pa.Table]:
    """Read each shard of the batch and label its documents; an unreadable shard yields one BAD_SHARD row."""
    for shard, uri in zip(batch["shard"].tolist(), batch["uri"].tolist(), strict=True):
        try:
            texts = list(iter_documents(uri, plan.text_field, plan.storage))
        except DataError as e:
            row = dict(id=[document_id(shard, 0)], shard=[shard], text=[""], hash=[""], raw_tokens=[0], tokens=[0])
            yield pa.table({**row, "removed_by": [BAD_SHARD], "error": [str(e)]}, schema=LABELED_SCHEMA)
            continue
        for start in range(0, len(texts), LABEL_CHUNK):
            yield _label_documents(shard, start, texts[start : start + LABEL_CHUNK], plan)


def _label_documents(shard: int, start: int, raw: list[str], plan: LabelPlan) -> pa.Table:
    clean = [normalize_text(t, plan.normalize) for t in raw]
    removed = [first_failed_filter(c, plan.thresholds) if c else NORMALIZE_EMPTY for c in clean]
    kept = [r == KEPT for r in removed]
    columns = {
        "id": [document_id(shard, start + i) for i in range(len(raw))],
        "shard": [shard] * len(raw),
        "text": [c if k else "" for c, k in zip(clean, kept, strict=True)],
        "hash": [dedup.content_hash(c) if k else "" for c, k in zip(clean, kept, strict=True)],
        "raw_tokens": count_tokens(raw, plan.tokenizer_json),
        "tokens": count_tokens(clean, plan.tokenizer_json),
        "removed_by": removed,
        "error": [None] * len(raw),
    }
    return pa.table(columns, schema=LABELED_SCHEMA)


def token_batch(table: pa.Table, tokenizer_json: str) -> pa.Table:
    texts = table.column("text").to_pylist()
    ids = [e.ids for e in _tokenizer(tokenizer_json).encode_batch(texts, add_special_tokens=False)]
    return pa.table({"id": table.column("id"), "tokens": pa.array(ids, type=pa.list_(pa.int32()))})


def for_prepare(message: str) -> str:
    """Shard and path errors name the training config's keys; point at this config's instead."""
    for train_key, prepare_key in (
        ("data.text_field", "input.text_field"),
        ("data.demo_corpus", "input.demo_corpus"),
    ):
        message = message.replace(train_key, prepare_key)
    return message


def bad_shards(labeled, shards: list[str], on_bad_shard: str) -> list[dict[str, str]]:
    """The unreadable shards, or a DataError naming the first when on_bad_shard is "error"."""
    from ray.data.expressions import col

    rows = labeled.filter(expr=col("removed_by") == BAD_SHARD).select_columns(["shard", "error"]).take_all()
    bad = sorted(({"uri": shards[r["shard"]], "error": for_prepare(r["error"])} for r in rows), key=lambda b: b["uri"])
    if on_bad_shard == "error":
        more = f" ({len(bad) - 1} more unreadable shard(s) besides)" if len(bad) > 1 else ""
        raise DataError(
            f"{bad[0]['error']}{more}. To leave unreadable shards out instead, set on_bad_shard: skip "
            "(the report names each one)"
        )
    return bad
