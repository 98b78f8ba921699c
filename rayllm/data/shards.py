"""Read the documents of one shard (jsonl, jsonl.gz/.zst, parquet, txt) through fsspec."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from rayllm.errors import DataError, StorageUnavailable
from rayllm.io.redact import display_uri
from rayllm.io.retry import is_transient, resumable, retrying
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem

T = TypeVar("T")
DEFAULT_MAX_DOCUMENT_BYTES = 64 << 20  # data.max_document_bytes's default
READ_BYTES = 1 << 20  # what one read takes from a shard, before or after decompression
# zstd's largest expansion: a 128 KiB block of one repeated byte is stored in 4 bytes. Fed at most
# max_document_bytes / ZSTD_MAX_RATIO compressed bytes at a time, the decoder gives at most the bound.
ZSTD_MAX_RATIO = 1 << 15
DROP_REASONS = ("not_text", "empty", "too_long")


@dataclass(frozen=True)
class ReadLimits:
    """What one document may take (data.max_document_bytes), and whether a longer one is left out and
    counted (data.on_bad_shard: skip) or an error naming the shard. Nothing longer is ever held whole:
    a newline-less file or a compressed bomb is stopped once past the bound."""

    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    skip_too_long: bool = False


@dataclass
class Dropped:
    """Records of a shard left out, by reason (DROP_REASONS), counted per source for the user."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))

    def add(self, reason: str) -> None:
        self.counts[reason] += 1

    def total(self) -> int:
        return sum(self.counts.values())

    def merge(self, other: Dropped) -> None:
        for reason, n in other.counts.items():
            self.counts[reason] += n


def _counted_once(read: Callable[[Dropped], Iterator[T]], dropped: Dropped | None) -> Iterator[T]:
    """``read``'s items, the records it left out added to ``dropped`` once it ends: a read cut off
    by a transient error is opened again from the shard's start and counts them anew, so the cut
    one's counts are let go (an error that ends the read keeps them: on_bad_shard's marker names them)."""
    mine = Dropped()
    try:
        yield from read(mine)
    except Exception as e:
        if dropped is not None and not (is_transient(e) and not isinstance(e, StorageUnavailable)):
            dropped.merge(mine)
        raise
    if dropped is not None:
        dropped.merge(mine)


def iter_documents(
    uri: str,
    text_field: str,
    storage: StorageSettings,
    limits: ReadLimits | None = None,
    dropped: Dropped | None = None,
) -> Iterator[str]:
    """Yield each document's text; raise DataError naming the shard when it cannot be read. Records
    left out (a text value that is no string or is empty; one over ``limits`` when skipping) are
    counted in ``dropped``.

    A network error or throttling mid-shard reopens it and skips the documents already given
    (rayllm.io.retry); past storage.retry_deadline_s it raises StorageUnavailable, which fails
    the attempt, never the run, and is no reason for data.on_bad_shard: skip to drop the shard.
    Records left out are counted once, reopened or not."""

    def documents_from(given: int) -> Iterator[str]:
        read = lambda mine: _documents(uri, text_field, storage, limits, mine)  # noqa: E731
        return itertools.islice(_counted_once(read, dropped), given, None)

    return resumable(documents_from, f"reading shard {display_uri(uri)}", storage.retry_deadline_s)


def _documents(
    uri: str, text_field: str, storage: StorageSettings, limits: ReadLimits | None, dropped: Dropped | None
) -> Iterator[str]:
    fs, path = filesystem(uri, storage)
    name = path.lower()
    limits, dropped = limits or ReadLimits(), dropped if dropped is not None else Dropped()
    try:
        if name.endswith(".parquet"):
            yield from _parquet_documents(fs, path, uri, text_field, limits, dropped)
        elif name.endswith(".txt"):
            yield from _txt_documents(fs, path, uri, limits, dropped)
        else:
            yield from _jsonl_documents(fs, path, uri, text_field, limits, dropped)
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
        return DataError(f"shard {display_uri(uri)} disappeared or cannot be found; check that it still exists")
    if isinstance(e, PermissionError):
        return DataError(
            f"shard {display_uri(uri)} cannot be read: access denied ({display_uri(str(e))}); check storage credentials"
        )
    # pyarrow, gzip, zstd and fsspec errors have no common base
    return DataError(
        f"shard {display_uri(uri)} is unreadable ({type(e).__name__}: {display_uri(str(e))}); fix or remove it"
    )


def _decode(raw: bytes, uri: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"shard {display_uri(uri)} is not valid UTF-8 ({e}); re-encode it as UTF-8") from None


def _too_long(uri: str, where: str, limit: int) -> DataError:
    return DataError(
        f"shard {display_uri(uri)} {where} is longer than data.max_document_bytes ({limit:,} bytes): a file without "
        "newlines or a compressed bomb? Fix or remove the shard, raise data.max_document_bytes, or set "
        "data.on_bad_shard: skip to leave such documents out (counted)"
    )


def _txt_documents(fs, path: str, uri: str, limits: ReadLimits, dropped: Dropped) -> Iterator[str]:
    """A .txt shard is one document: read up to the bound and no further."""
    limit = limits.max_document_bytes
    with fs.open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        if not limits.skip_too_long:
            raise _too_long(uri, "(one document)", limit)
        dropped.add("too_long")
        return
    text = _decode(raw, uri)
    if text:
        yield text
    else:
        dropped.add("empty")


def _zstd_chunks(fs, path: str, uri: str, limit: int) -> Iterator[bytes]:
    """A .zst file's bytes, decompressed a bounded piece at a time; a file cut short mid-frame is an error.

    zstandard's stream reader returns a truncated frame's bytes without complaint, and its
    ``decompressobj`` has no output limit, so frames are decoded here, fed a few compressed bytes
    at a time (at most ``limit`` out per feed), and checked for their end.
    """
    import zstandard

    feed = max(64, min(READ_BYTES, limit // ZSTD_MAX_RATIO))
    in_frame = False
    decoder = zstandard.ZstdDecompressor().decompressobj()
    with fs.open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            view = memoryview(chunk)
            for lo in range(0, len(view), feed):
                piece = bytes(view[lo : lo + feed])
                while piece:
                    out = decoder.decompress(piece)
                    in_frame = not decoder.eof
                    piece = decoder.unused_data if decoder.eof else b""
                    if decoder.eof:
                        decoder = zstandard.ZstdDecompressor().decompressobj()
                    if out:
                        yield out
    if in_frame:
        raise DataError(
            f"shard {display_uri(uri)} is truncated (its zstd stream ends mid-frame); re-upload or remove it"
        )


def _chunks(fs, path: str, uri: str, limit: int) -> Iterator[bytes]:
    """A shard's bytes, decompressed, READ_BYTES at most at a time (gzip, bz2, xz through fsspec)."""
    if path.lower().endswith(".zst"):
        yield from _zstd_chunks(fs, path, uri, limit)
        return
    with fs.open(path, "rb", compression="infer") as f:
        while chunk := f.read(READ_BYTES):
            yield chunk


def _lines(chunks: Iterator[bytes], uri: str, limits: ReadLimits, dropped: Dropped) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a byte stream; a line over the bound is never held whole: an error
    naming the shard and line, or (skipping) let stream past and counted.

    Written by hand: a file object's readline holds a newline-less file whole."""
    limit = limits.max_document_bytes
    pending: list[bytes] = []
    have, lineno, over = 0, 1, False
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not over and have + len(piece) > limit:
                if not limits.skip_too_long:
                    raise _too_long(uri, f"line {lineno}", limit)
                over, pending, have = True, [], 0
            if not over and piece:
                pending.append(piece)
                have += len(piece)
            if end < 0:
                break
            if over:
                dropped.add("too_long")
            else:
                yield lineno, b"".join(pending)
            pending, have, lineno, over, start = [], 0, lineno + 1, False, end + 1
    if over:
        dropped.add("too_long")
    elif have:
        yield lineno, b"".join(pending)


def _text_of(value, dropped: Dropped, limits: ReadLimits, uri: str, where: str) -> str | None:
    """A record's text, or None (counted) when it is no string, is empty, or (skipping) is too long."""
    if not isinstance(value, str):
        dropped.add("not_text")
        return None
    if not value:
        dropped.add("empty")
        return None
    if len(value) > limits.max_document_bytes:  # characters: at least as many bytes
        if not limits.skip_too_long:
            raise _too_long(uri, where, limits.max_document_bytes)
        dropped.add("too_long")
        return None
    return value


def _jsonl_documents(fs, path: str, uri: str, text_field: str, limits: ReadLimits, dropped: Dropped) -> Iterator[str]:
    chunks = _chunks(fs, path, uri, limits.max_document_bytes)
    for lineno, raw in _lines(chunks, uri, limits, dropped):
        if not raw.strip():
            continue
        try:
            record = json.loads(_decode(raw, uri))
        except json.JSONDecodeError as e:
            raise DataError(
                f"shard {display_uri(uri)} line {lineno} is not valid JSON ({e.msg}); fix or remove it"
            ) from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(
                f"shard {display_uri(uri)} line {lineno} has no {text_field!r} field; set data.text_field to the "
                f"field that holds the text"
            )
        text = _text_of(record[text_field], dropped, limits, uri, f"line {lineno}")
        if text is not None:
            yield text


def _parquet_documents(fs, path: str, uri: str, text_field: str, limits: ReadLimits, dropped: Dropped) -> Iterator[str]:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        if text_field not in pf.schema_arrow.names:
            raise DataError(
                f"shard {display_uri(uri)} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                f"set data.text_field"
            )
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                text = _text_of(value, dropped, limits, uri, f"row {row}")
                if text is not None:
                    yield text


TOKENS_COLUMN = "tokens"


def iter_token_documents(
    uri: str, storage: StorageSettings, limits: ReadLimits | None = None, dropped: Dropped | None = None
) -> Iterator[list[int]] | None:
    """Token ids per document when ``uri`` is a pre-tokenised parquet shard (a ``tokens`` column), else None.

    ``rayllm prepare`` writes such shards; the trainer streams them without a tokenizer. A document
    of more tokens than data.max_document_bytes came from a longer text (a token is at least one
    byte): refused naming the shard, or left out and counted, as a text reader does with its text.
    """
    if not uri.lower().endswith(".parquet"):
        return None
    import pyarrow.parquet as pq

    fs, path = filesystem(uri, storage)

    def column_names() -> list[str]:
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).schema_arrow.names

    try:
        names = retrying(column_names, f"reading shard {display_uri(uri)}", storage.retry_deadline_s)
    except StorageUnavailable:
        raise
    except Exception:
        return None  # unreadable: the text reader raises the error that names the shard
    if TOKENS_COLUMN not in names:
        return None

    def lists_from(given: int) -> Iterator[np.ndarray]:
        read = lambda mine: _token_lists(fs, path, uri, limits or ReadLimits(), mine)  # noqa: E731
        return itertools.islice(_counted_once(read, dropped), given, None)

    return resumable(lists_from, f"reading shard {display_uri(uri)}", storage.retry_deadline_s)


def _token_lists(fs, path: str, uri: str, limits: ReadLimits, dropped: Dropped) -> Iterator[np.ndarray]:
    """Each document's token ids as a view into its batch's values (no Python list per document)."""
    import pyarrow.parquet as pq

    row = 0
    try:
        with fs.open(path, "rb") as f:
            for batch in pq.ParquetFile(f).iter_batches(columns=[TOKENS_COLUMN], batch_size=1024):
                column = batch.column(0)
                # offsets index the whole values buffer (.values ignores a slice's offset, offsets keep it)
                offsets = column.offsets.to_numpy()
                values = column.values.to_numpy(zero_copy_only=False)
                for lo, hi in zip(offsets[:-1], offsets[1:], strict=True):
                    row += 1
                    if hi - lo > limits.max_document_bytes:
                        if not limits.skip_too_long:
                            raise _too_long(uri, f"row {row}", limits.max_document_bytes)
                        dropped.add("too_long")
                    elif hi > lo:
                        yield values[lo:hi]
                    else:
                        dropped.add("empty")
    except Exception as e:
        mapped = _shard_error(uri, e)
        if mapped is e:
            raise
        raise mapped from None
