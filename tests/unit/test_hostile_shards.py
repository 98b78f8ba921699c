"""Hostile or odd shards (rayllm/data/shards.py): a compressed bomb, a newline-less file or an oversized
.txt shard is stopped at data.max_document_bytes (memory stays near the bound, not the file's size)
and named, or with on_bad_shard: skip left out and counted; text values that are no string or empty
are counted per source, once per shard visit, across a restart too. Real files, read through fsspec."""

import gzip
import itertools
import json
import tracemalloc

import numpy as np
import pytest
import zstandard

from rayllm.data.order import StreamSpec, local_stream
from rayllm.data.shards import Dropped, ReadLimits, iter_documents
from rayllm.data.source import SourceSpec
from rayllm.errors import DataError
from rayllm.io.settings import StorageSettings

S = StorageSettings()
BOUND = 1 << 20  # data.max_document_bytes in these tests
BOMB = 200 << 20  # what the bombs decompress to: 200 MB without a newline
GOOD = [json.dumps({"text": f"good document {i}"}).encode() + b"\n" for i in range(2)]


def _gzip_bomb(path) -> None:
    """A good line, 200 MB of newline-less bytes, a good line: three gzip members (~200 KB)."""
    with open(path, "wb") as f:
        f.write(gzip.compress(GOOD[0]))
        with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1) as z:
            block = b"a" * (1 << 20)
            for _ in range(BOMB >> 20):
                z.write(block)
        f.write(gzip.compress(b"\n" + GOOD[1]))


def _zstd_bomb(path) -> None:
    """The same as zstd frames (a few KB)."""
    c = zstandard.ZstdCompressor()
    with open(path, "wb") as f:
        f.write(c.compress(GOOD[0]))
        z = c.compressobj()
        block = b"a" * (1 << 20)
        for _ in range(BOMB >> 20):
            f.write(z.compress(block))
        f.write(z.flush())
        f.write(c.compress(b"\n" + GOOD[1]))


def _newline_less(path) -> None:
    """A plain jsonl shard of 32 MB with no newline at all."""
    with open(path, "wb") as f:
        f.write(b'{"text": "')
        for _ in range(32):
            f.write(b"b" * (1 << 20))


def _read(path, skip: bool) -> tuple[list[str], Dropped, int]:
    """The documents, what was left out, and the peak Python memory of reading them."""
    dropped = Dropped()
    tracemalloc.start()
    try:
        docs = list(iter_documents(str(path), "text", S, ReadLimits(BOUND, skip_too_long=skip), dropped))
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return docs, dropped, peak


@pytest.mark.parametrize("name, make", [("bomb.jsonl.gz", _gzip_bomb), ("bomb.jsonl.zst", _zstd_bomb)])
def test_a_compressed_bomb_is_stopped_at_the_bound_and_named_or_skipped_and_counted(tmp_path, name, make):
    path = tmp_path / name
    make(path)
    assert path.stat().st_size < 1 << 20  # a few hundred KB at most, 200 MB inside
    tracemalloc.start()
    with pytest.raises(DataError) as info:
        list(iter_documents(str(path), "text", S, ReadLimits(BOUND)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(path) in str(info.value) and "line 2 is longer than data.max_document_bytes (1,048,576" in str(
        info.value
    )
    assert peak < 8 * BOUND, peak  # stopped early: never near the 200 MB it holds

    docs, dropped, peak = _read(path, skip=True)
    assert docs == ["good document 0", "good document 1"]  # the lines around it are kept
    assert dropped.counts == {"not_text": 0, "empty": 0, "too_long": 1}
    assert peak < 8 * BOUND, peak  # streamed past, never held


def test_a_newline_less_shard_is_stopped_at_the_bound_and_named(tmp_path):
    path = tmp_path / "one-line.jsonl"
    _newline_less(path)
    tracemalloc.start()
    with pytest.raises(DataError, match=r"one-line\.jsonl line 1 is longer than data\.max_document_bytes"):
        list(iter_documents(str(path), "text", S, ReadLimits(BOUND)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * BOUND, peak  # the file is 32 MB
    docs, dropped, peak = _read(path, skip=True)
    assert docs == [] and dropped.counts["too_long"] == 1 and peak < 4 * BOUND


def test_a_txt_shard_is_one_document_up_to_the_bound(tmp_path):
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    small.write_text("def f():\n    return 1\n")
    big.write_bytes(b"x" * (3 * BOUND))
    assert list(iter_documents(str(small), "text", S, ReadLimits(BOUND))) == ["def f():\n    return 1\n"]
    with pytest.raises(DataError, match=r"big\.txt \(one document\) is longer than data\.max_document_bytes"):
        list(iter_documents(str(big), "text", S, ReadLimits(BOUND)))
    docs, dropped, peak = _read(big, skip=True)
    assert docs == [] and dropped.counts["too_long"] == 1 and peak < 2.5 * BOUND


def test_text_values_that_are_no_string_or_empty_are_counted(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [None, 3, ["a list"], {"a": "dict"}, "", "kept", True]
    (tmp_path / "odd.jsonl").write_text("".join(json.dumps({"text": v}) + "\n" for v in values))
    dropped = Dropped()
    assert list(iter_documents(str(tmp_path / "odd.jsonl"), "text", S, dropped=dropped)) == ["kept"]
    assert dropped.counts == {"not_text": 5, "empty": 1, "too_long": 0}
    pq.write_table(pa.table({"text": ["kept", None, "", "also kept"]}), tmp_path / "odd.parquet")
    dropped = Dropped()
    assert list(iter_documents(str(tmp_path / "odd.parquet"), "text", S, dropped=dropped)) == ["kept", "also kept"]
    assert dropped.counts == {"not_text": 1, "empty": 1, "too_long": 0}


def _odd_source(tmp_path, tokenizer_file) -> SourceSpec:
    """Three shards of real text, each with records the stream leaves out (2 no string, 1 empty, 1 too long)."""
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    for i in range(3):
        docs = [" ".join(words[(i + d + k) % 8] + str(k % 13) for k in range(300)) for d in range(4)]
        odd = [None, 7, "", "z" * 5000]
        lines = [json.dumps({"text": t}) for pair in zip(docs, odd, strict=True) for t in pair]
        (tmp_path / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")
    return SourceSpec(
        name="odd",
        shards=sorted(str(p) for p in tmp_path.glob("part-*.jsonl")),
        weight=1.0,
        text_field="text",
        storage=S,
        tokenizer_json=tokenizer_file.read_text(),
        seq_len=64,
        seed=7,
        on_bad_shard="skip",
        max_document_bytes=4096,
    )


def test_the_stream_counts_what_each_source_left_out_once_across_a_restart(tmp_path, tokenizer_file):
    plan = StreamSpec(sources=[_odd_source(tmp_path, tokenizer_file)], window=16, seed=7)
    full = [batch for _, batch in zip(range(40), local_stream(plan, global_batch=8), strict=False)]
    visits = full[-1][1].dropped["odd"]["empty"]  # each shard visit read to its end leaves out 2 + 1 + 1
    assert visits >= 3 and full[-1][1].dropped == {"odd": {"not_text": 2 * visits, "empty": visits, "too_long": visits}}
    for step in (2, 9, 20):
        _, state = full[step]
        state = type(state).from_dict(json.loads(json.dumps(state.to_dict())))  # as a checkpoint keeps it
        stream = local_stream(plan, state, consumed=(step + 1) * 8, global_batch=8)
        resumed = [batch for _, batch in zip(range(39 - step), stream, strict=False)]
        assert np.array_equal(resumed[-1][0], full[-1][0])
        assert resumed[-1][1].dropped == full[-1][1].dropped, step  # nothing counted twice, nothing lost


def test_a_pretokenised_document_past_the_bound_is_named_or_skipped_and_counted(tmp_path):
    """A token is at least one byte of text: a token list longer than data.max_document_bytes came from
    a longer document, refused naming the shard and row, or (skip) left out and counted with the empty ones."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayllm.data.shards import iter_token_documents

    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "tokens": [[1, 2, 3], [], list(range(5000)), [4, 5]]}), path)
    with pytest.raises(DataError, match=r"shard .*tokens.parquet row 3 is longer than data.max_document_bytes \(4,096"):
        list(iter_token_documents(str(path), S, ReadLimits(4096)))
    dropped = Dropped()
    docs = iter_token_documents(str(path), S, ReadLimits(4096, skip_too_long=True), dropped)
    assert [list(d) for d in docs] == [[1, 2, 3], [4, 5]]
    assert dropped.counts == {"not_text": 0, "empty": 1, "too_long": 1}


def test_records_left_out_before_a_reopen_are_counted_once():
    """resumable reopens a read cut by a transient error from the shard's start: what the cut read
    counted is let go, the reopened one counts the whole shard; an error that ends the read keeps its counts."""
    from rayllm.data.shards import _counted_once
    from rayllm.io.retry import resumable

    opens = []

    def read(mine: Dropped):  # a shard of 4 documents with 1 left out before each
        opens.append(1)
        for i in range(4):
            mine.add("empty")
            if len(opens) == 1 and i == 2:
                raise ConnectionResetError(104, "Connection reset by peer")  # the first read, mid-shard
            yield f"doc {i}"

    dropped = Dropped()
    docs = list(resumable(lambda given: itertools.islice(_counted_once(read, dropped), given, None), "read", 30))
    assert docs == [f"doc {i}" for i in range(4)] and len(opens) == 2
    assert dropped.counts["empty"] == 4, "the cut read's 3 are not added to the reopened read's 4"

    def bad(mine: Dropped):
        mine.add("not_text")
        yield "doc 0"
        raise DataError("shard x is unreadable")

    dropped = Dropped()
    with pytest.raises(DataError):
        list(_counted_once(bad, dropped))
    assert dropped.counts["not_text"] == 1, "on_bad_shard: skip's marker counts what came before the error"
