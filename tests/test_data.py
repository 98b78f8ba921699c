"""Data: shard readers, packing, and a global order that does not depend on the world size."""

import gzip
import itertools
import json

import numpy as np
import pytest

from rayllm.config import StorageSettings
from rayllm.data.packing import pack
from rayllm.data.pipeline import StreamPlan, local_stream, rank_batches, work_items
from rayllm.data.shards import iter_documents
from rayllm.errors import DataError

S = StorageSettings()


def test_pack_separates_documents_with_eos_and_keeps_order():
    blocks = np.concatenate(list(pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], eos=0, block=4, chunk=2)))
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]


def test_readers_agree_across_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["alpha beta", "gamma", "delta epsilon"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq.write_table(pa.Table.from_pylist([{"text": d} for d in docs]), tmp_path / "a.parquet")
    for name in ("a.jsonl", "a.jsonl.gz", "a.parquet"):
        assert list(iter_documents(str(tmp_path / name), "text", S)) == docs


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.parquet", b"not a parquet file at all", "unreadable"),
        ("bad.jsonl.gz", b"\x1f\x8b\x08garbage", "unreadable"),
        ("bad.jsonl", b'{"text": "ok"}\n{"text": \n', "line 2 is not valid JSON"),
        ("latin.jsonl", b'{"text": "caf\xe9"}\n', "not valid UTF-8"),
        ("field.jsonl", b'{"body": "x"}\n', "has no 'text' field"),
    ],
)
def test_bad_shards_name_the_shard_and_problem(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        list(iter_documents(str(path), "text", S))
    assert name in str(info.value)


def take(n, iterator):
    return list(itertools.islice(iterator, n))


def _plan(corpus, tokenizer_file, epochs=1):
    return StreamPlan(
        shards=sorted(str(p) for p in (corpus / "train").glob("*.jsonl")),
        text_field="text",
        storage=S,
        tokenizer_json=tokenizer_file.read_text(),
        seq_len=64,
        seed=7,
        epochs=epochs,
    )


def test_epochs_reshuffle_shards_by_seed(corpus, tokenizer_file):
    items = work_items(_plan(corpus, tokenizer_file, epochs=4))
    orders = [tuple(i["shard"] for i in items if i["epoch"] == e) for e in range(4)]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert len(set(orders)) > 1
    assert work_items(_plan(corpus, tokenizer_file, epochs=4)) == items


def batches(plan, start=0, rank=0, world_size=1, n=6):
    stream = rank_batches(
        lambda: local_stream(plan), start=start, global_batch=8, rank=rank, world_size=world_size, repeat=False
    )
    return take(n, stream)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_see_exactly_the_single_process_batches(corpus, tokenizer_file, world_size):
    plan = _plan(corpus, tokenizer_file)
    single = batches(plan)
    per_rank = [batches(plan, rank=r, world_size=world_size) for r in range(world_size)]
    for step in range(6):
        assert np.array_equal(np.concatenate([per_rank[r][step] for r in range(world_size)]), single[step])


def test_resume_position_continues_with_next_unseen_sequence(corpus, tokenizer_file):
    plan = _plan(corpus, tokenizer_file)
    full = batches(plan, n=5)
    assert np.array_equal(batches(plan, start=3 * 8, n=1)[0], full[3])


def test_empty_stream_is_an_error(tmp_path, tokenizer_file):
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    plan = StreamPlan([str(tmp_path / "short.jsonl")], "text", S, tokenizer_file.read_text(), 64, 0, 1)
    with pytest.raises(DataError, match="produced no sequences"):
        next(rank_batches(lambda: local_stream(plan), start=0, global_batch=8, rank=0, world_size=1, repeat=True))


def test_window_shuffle_is_a_seeded_permutation_independent_of_chunking():
    from rayllm.data.pipeline import window_shuffled

    rows = np.arange(50, dtype=np.int32).reshape(25, 2)

    def chunks(size):
        return lambda: (rows[i : i + size] for i in range(0, len(rows), size))

    a = np.concatenate(list(window_shuffled(chunks(3), window=8, seed=1)()))
    b = np.concatenate(list(window_shuffled(chunks(7), window=8, seed=1)()))
    assert np.array_equal(a, b)
    assert sorted(a[:, 0].tolist()) == rows[:, 0].tolist()  # every sequence exactly once
    assert not np.array_equal(a, rows)
    assert sorted(a[:8, 0].tolist()) == rows[:8, 0].tolist()  # permuted only within its window


def test_zstd_and_text_shards(tmp_path):
    import zstandard

    docs = ["alpha beta", "gamma"]
    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "b.txt").write_text("a whole document\non two lines\n")
    assert list(iter_documents(str(tmp_path / "a.jsonl.zst"), "text", S)) == docs
    assert list(iter_documents(str(tmp_path / "b.txt"), "text", S)) == ["a whole document\non two lines\n"]
    (tmp_path / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw)[:-6])
    with pytest.raises(DataError, match="cut.jsonl.zst"):
        list(iter_documents(str(tmp_path / "cut.jsonl.zst"), "text", S))


def test_tokenizer_train_cli_writes_a_loadable_tokenizer(corpus, tmp_path):
    import subprocess
    import sys

    from tokenizers import Tokenizer

    out = tmp_path / "tok" / "tokenizer.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayllm.cli",
            "tokenizer",
            "train",
            "configs/tiny.yaml",
            f"data.train={corpus / 'train'}",
            "data.tokenizer_sample_docs=100",
            "--vocab-size",
            "600",
            "--special-tokens",
            "<pad>",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tokenizer = Tokenizer.from_file(str(out))
    assert tokenizer.get_vocab_size() == 600
    assert tokenizer.token_to_id("<|endoftext|>") == 0 and tokenizer.token_to_id("<pad>") == 1
    text = "def main():\n    print('hello')\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text  # byte-level: lossless
