"""Read the documents of one shard (jsonl, jsonl.gz/.zst, parquet, txt) through fsspec."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import numpy as np

from rayllm.errors import DataError, StorageUnavailable
from rayllm.io.retry import is_transient, resumable, retrying
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem


def iter_documents(uri: str, text_field: str, storage: StorageSettings) -> Iterator[str]:
    """Yield each document's text; raise DataError naming the shard when it cannot be read.

    A network error or throttling mid-shard reopens it and skips the documents already given
    (rayllm.io.retry); past storage.retry_deadline_s it raises StorageUnavailable, which fails
    the attempt, never the run, and is no reason for data.on_bad_shard: skip to drop the shard."""

    def documents_from(given: int) -> Iterator[str]:
        return itertools.islice(_documents(uri, text_field, storage), given, None)

    return resumable(documents_from, f"reading shard {uri}", storage.retry_deadline_s)


def _documents(uri: str, text_field: str, storage: StorageSettings) -> Iterator[str]:
    fs, path = filesystem(uri, storage)
    name = path.lower()
    try:
        if name.endswith(".parquet"):
            yield from _parquet_documents(fs, path, uri, text_field)
        elif name.endswith(".txt"):
            with fs.open(path, "rb") as f:
                yield _decode(f.read(), uri)
        else:
            yield from _jsonl_documents(fs, path, uri, text_field)
    except Exception as e:
        mapped = _shard_error(uri, e)
        if mapped is e:
            raise
        raise mapped from None


def _shard_error(uri: str, e: Exception) -> Exception:
    """A read error by its cause: a transient one as it is (retried), else a DataError naming the shard."""
    if isinstance(e, DataError) or is_transient(e):
        return e
    if isinstance(e, FileNotFoundError):
        return DataError(f"shard {uri} disappeared or cannot be found; check that it still exists")
    if isinstance(e, PermissionError):
        return DataError(f"shard {uri} cannot be read: access denied ({e}); check storage credentials")
    # pyarrow, gzip, zstd and fsspec errors have no common base
    return DataError(f"shard {uri} is unreadable ({type(e).__name__}: {e}); fix or remove it")


def _decode(raw: bytes, uri: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"shard {uri} is not valid UTF-8 ({e}); re-encode it as UTF-8") from None


def _zstd_lines(fs, path: str, uri: str) -> Iterator[bytes]:
    """Lines of a .zst file, frame by frame; a file cut short mid-frame is an error.

    zstandard's stream reader returns a truncated frame's bytes without complaint, so
    frames are decoded here with ``decompressobj`` and checked for their end.
    """
    import zstandard

    pending, in_frame = b"", False
    decoder = zstandard.ZstdDecompressor().decompressobj()
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            while chunk:
                pending += decoder.decompress(chunk)
                in_frame = not decoder.eof
                chunk = decoder.unused_data if decoder.eof else b""
                if decoder.eof:
                    decoder = zstandard.ZstdDecompressor().decompressobj()
            *lines, pending = pending.split(b"\n")
            yield from lines
    if in_frame:
        raise DataError(f"shard {uri} is truncated (its zstd stream ends mid-frame); re-upload or remove it")
    if pending:
        yield pending


def _lines(fs, path: str, uri: str) -> Iterator[bytes]:
    if path.lower().endswith(".zst"):
        yield from _zstd_lines(fs, path, uri)
        return
    with fs.open(path, "rb", compression="infer") as f:
        yield from f


def _jsonl_documents(fs, path: str, uri: str, text_field: str) -> Iterator[str]:
    for lineno, raw in enumerate(_lines(fs, path, uri), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(_decode(raw, uri))
        except json.JSONDecodeError as e:
            raise DataError(f"shard {uri} line {lineno} is not valid JSON ({e.msg}); fix or remove it") from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(
                f"shard {uri} line {lineno} has no {text_field!r} field; set data.text_field to the "
                f"field that holds the text"
            )
        text = record[text_field]
        if isinstance(text, str) and text:
            yield text


def _parquet_documents(fs, path: str, uri: str, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        if text_field not in pf.schema_arrow.names:
            raise DataError(
                f"shard {uri} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                f"set data.text_field"
            )
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str) and text:
                    yield text


TOKENS_COLUMN = "tokens"


def iter_token_documents(uri: str, storage: StorageSettings) -> Iterator[list[int]] | None:
    """Token ids per document when ``uri`` is a pre-tokenised parquet shard (a ``tokens`` column), else None.

    ``rayllm prepare`` writes such shards; the trainer streams them without a tokenizer.
    """
    if not uri.lower().endswith(".parquet"):
        return None
    import pyarrow.parquet as pq

    fs, path = filesystem(uri, storage)

    def column_names() -> list[str]:
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).schema_arrow.names

    try:
        names = retrying(column_names, f"reading shard {uri}", storage.retry_deadline_s)
    except StorageUnavailable:
        raise
    except Exception:
        return None  # unreadable: the text reader raises the error that names the shard
    if TOKENS_COLUMN not in names:
        return None

    def lists_from(given: int) -> Iterator[np.ndarray]:
        return itertools.islice(_token_lists(fs, path, uri), given, None)

    return resumable(lists_from, f"reading shard {uri}", storage.retry_deadline_s)


def _token_lists(fs, path: str, uri: str) -> Iterator[np.ndarray]:
    """Each document's token ids as a view into its batch's values (no Python list per document)."""
    import pyarrow.parquet as pq

    try:
        with fs.open(path, "rb") as f:
            for batch in pq.ParquetFile(f).iter_batches(columns=[TOKENS_COLUMN], batch_size=1024):
                column = batch.column(0)
                # offsets index the whole values buffer (.values ignores a slice's offset, offsets keep it)
                offsets = column.offsets.to_numpy()
                values = column.values.to_numpy(zero_copy_only=False)
                for lo, hi in zip(offsets[:-1], offsets[1:], strict=True):
                    if hi > lo:
                        yield values[lo:hi]
    except Exception as e:
        mapped = _shard_error(uri, e)
        if mapped is e:
            raise
        raise mapped from None
