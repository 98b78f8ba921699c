"""Data: shard readers, packing, and a global order that does not depend on the world size."""

import gzip
import itertools
import json

import numpy as np
import pytest

from rayllm.data.order import StreamSpec, local_stream, rank_slice
from rayllm.data.packing import pack
from rayllm.data.shard_groups import GroupPacker, group_members
from rayllm.data.shards import iter_documents
from rayllm.data.source import ID_FIELDS, ShardPacker, SourceSpec
from rayllm.errors import DataError
from rayllm.io.settings import StorageSettings

S = StorageSettings()


def test_pack_separates_documents_with_eos_and_marks_where_each_block_starts():
    out = list(pack(enumerate([[1, 2, 3], [4, 5], [6, 7, 8, 9]]), eos=0, block=4, chunk=2))
    assert np.concatenate([b for b, _, _ in out]).tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert np.concatenate([d for _, d, _ in out]).tolist() == [0, 1, 2]
    assert np.concatenate([o for _, _, o in out]).tolist() == [0, 0, 1]
    # Restarting at the third block's start (document 2, token 1) gives the same block.
    again = list(pack([(2, [6, 7, 8, 9])], eos=0, block=4, first_offset=1))
    assert again[0][0].tolist() == [[7, 8, 9, 0]]


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


def _source(corpus, tokenizer_file, index=0, weight=1.0, name="train", folder="train"):
    return SourceSpec(
        name=name,
        shards=sorted(str(p) for p in (corpus / folder).glob("*.jsonl")),
        weight=weight,
        text_field="text",
        storage=S,
        tokenizer_json=tokenizer_file.read_text(),
        seq_len=64,
        seed=7,
        index=index,
    )


def _plan(corpus, tokenizer_file, window=32, sources=None):
    return StreamSpec(sources=sources or [_source(corpus, tokenizer_file)], window=window, seed=7)


def test_epochs_reshuffle_shards_by_seed(corpus, tokenizer_file):
    plan = _source(corpus, tokenizer_file)
    plan.mix = 1  # one shard per group: the group list is the epochs' shard permutations
    orders = [tuple(group_members(plan, e * 3 + j)[0][1] for j in range(3)) for e in range(4)]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert len(set(orders)) > 1
    assert orders == [tuple(group_members(plan, e * 3 + j)[0][1] for j in range(3)) for e in range(4)]
    plan.mix = 2  # an epoch of 3 shards in groups of 2 and 1, never across epochs
    assert [len(group_members(plan, g)) for g in range(4)] == [1, 2, 1, 2]
    assert sorted(s for g in (0, 1) for _, s in group_members(plan, g)) == [0, 1, 2]


@pytest.mark.parametrize("window", [1, 32, 100])
def test_restart_from_any_saved_state_continues_with_the_next_unseen_sequence(corpus, tokenizer_file, window):
    """The state saved after each step restarts the stream exactly there, shuffled or not, on any world size."""
    plan = _plan(corpus, tokenizer_file, window=window)
    full = take(30, local_stream(plan, global_batch=8))
    for step in (0, 3, 11, 12, 25):
        _, state = full[step]
        resumed = take(4, local_stream(plan, state, consumed=(step + 1) * 8, global_batch=8))
        for k, (rows, _) in enumerate(resumed):
            assert np.array_equal(rows, full[step + 1 + k][0]), (step, k)
    ids = [tuple(r) for rows, _ in full for r in rows[list(ID_FIELDS)]]
    assert len(ids) == len(set(ids))


def test_rank_slices_together_are_the_global_batch(corpus, tokenizer_file):
    plan = _plan(corpus, tokenizer_file)
    for rows, _ in take(5, local_stream(plan, global_batch=8)):
        for world in (1, 2, 4):
            assert np.array_equal(np.concatenate([rank_slice(rows, r, world) for r in range(world)]), rows)


def test_restart_tokenizes_only_from_the_cursor(corpus, tokenizer_file):
    """A restart reads the current shard up to the cursor's document but tokenizes nothing before it."""
    plan = _plan(corpus, tokenizer_file, window=64)
    full = take(40, local_stream(plan, global_batch=8))
    _, state = full[30]
    group, slots = state.cursor(0, plan.sources[0])
    slot = max(range(len(slots)), key=lambda s: slots[s][1] if slots[s] else -1)
    index, doc, _ = slots[slot]
    assert doc > 0, "the cursor should lie past the first document of its shard"
    encoded = []

    class CountingPacker(ShardPacker):
        def __init__(self, plan):
            super().__init__(plan)
            original = self.tokenizer.encode_batch
            self.tokenizer = type("T", (), {})()
            self.tokenizer.encode_batch = lambda texts, **kw: encoded.extend(texts) or original(texts, **kw)

    packer = GroupPacker(plan.sources[0])
    packer.shards = CountingPacker(plan.sources[0])
    only = [c if s == slot else None for s, c in enumerate(slots)]
    members = group_members(plan.sources[0], group)
    rows = next(r for r in packer.rows(group, only) if (r["slot"] == slot).any())
    assert rows["index"][rows["slot"] == slot][0] == index + 1
    docs = list(iter_documents(plan.sources[0].shards[members[slot][1]], "text", S))
    assert docs[doc] in encoded  # the cursor's own document is tokenized ...
    assert not set(docs[:doc]) & set(encoded)  # ... and none before it


def test_weighted_mixture_is_realised_and_independent_of_restarts(corpus, tokenizer_file, tmp_path):
    from rayllm.data import mixture

    a = _source(corpus, tokenizer_file, index=0, weight=0.7, name="a")
    b = _source(corpus, tokenizer_file, index=1, weight=0.3, name="b", folder="train")
    plan = _plan(corpus, tokenizer_file, window=64, sources=[a, b])
    full = take(64, local_stream(plan, global_batch=16))
    sources = np.concatenate([rows["source"] for rows, _ in full])
    assert abs((sources == 0).mean() - 0.7) < 0.03
    _, state = full[40]
    resumed = take(5, local_stream(plan, state, consumed=41 * 16, global_batch=16))
    for k, (rows, _) in enumerate(resumed):
        assert np.array_equal(rows, full[41 + k][0])
    # Labels are random-access: any range agrees with the whole.
    whole = mixture.labels([0.7, 0.3], 0, 5000, seed=3)
    assert np.array_equal(mixture.labels([0.7, 0.3], 1234, 4321, seed=3), whole[1234:4321])
    assert abs((whole[:4096] == 0).mean() - 0.7) <= 1 / mixture.BLOCK


def test_bad_shard_is_skipped_and_counted_when_the_config_says_skip(corpus, tokenizer_file, tmp_path):
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    for i in range(3):
        docs = [" ".join(words[(i + d + k) % 8] + str(k % 13) for k in range(300)) for d in range(4)]
        (tmp_path / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "part-9.jsonl.gz").write_bytes(b"\x1f\x8b\x08garbage")
    source = _source(corpus, tokenizer_file)
    source.shards = sorted(str(p) for p in tmp_path.iterdir())
    with pytest.raises(DataError, match="part-9.jsonl.gz"):
        take(400, local_stream(_plan(corpus, tokenizer_file, sources=[source]), global_batch=8))
    source.on_bad_shard = "skip"
    batches = take(200, local_stream(_plan(corpus, tokenizer_file, sources=[source]), global_batch=8))
    skipped = batches[-1][1].skipped
    assert {s["uri"] for s in skipped} == {str(tmp_path / "part-9.jsonl.gz")}
    assert "unreadable" in skipped[0]["error"]
    assert {int(s) for rows, _ in batches for s in rows["shard"]} == {0, 1, 2}


def test_empty_stream_is_an_error(tmp_path, tokenizer_file, corpus):
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    source = _source(corpus, tokenizer_file)
    source.shards = [str(tmp_path / "short.jsonl")]
    with pytest.raises(DataError, match="produced no sequences"):
        next(local_stream(_plan(corpus, tokenizer_file, sources=[source]), global_batch=8))


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
