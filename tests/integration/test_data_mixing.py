"""Data at corpus scale, without Ray: with the default settings each global batch draws from most of a
32-shard corpus, not from one or two shards (a whole epoch of batches: seconds, so not in tests/unit)."""

import json

import numpy as np

from rayllm.data.order import StreamSpec, local_stream
from rayllm.data.source import SourceSpec
from rayllm.io.settings import StorageSettings

S = StorageSettings()


def _write_shards(folder, count, rng):
    """``count`` jsonl shards of a few hundred 65-token sequences each, sizes varying by shard."""
    folder.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    for s in range(count):
        docs = [" ".join(rng.choice(words, size=int(rng.integers(50, 400)))) for _ in range(int(rng.integers(60, 140)))]
        (folder / f"part-{s:03d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def _distinct_shards_per_batch(plan, global_batch):
    out = []
    for rows, _ in local_stream(plan, global_batch=global_batch):
        if (rows["epoch"] > 0).any():
            return out
        out.append(len(set(rows["shard"].tolist())))
    return out


def test_each_global_batch_mixes_many_shards(tmp_path, tokenizer_file):
    """With the defaults, a batch of 64 draws from most of a 32-shard corpus, not from one or two shards."""
    from rayllm.config import DataSettings
    from rayllm.io.storage import list_shards

    _write_shards(tmp_path / "c", 32, np.random.default_rng(0))
    listed = list_shards(str(tmp_path / "c"), S, "test")
    defaults = DataSettings()
    source = SourceSpec(
        name="train",
        shards=[u for u, _ in listed],
        sizes=[n for _, n in listed],
        weight=1.0,
        text_field="text",
        storage=S,
        tokenizer_json=tokenizer_file.read_text(),
        seq_len=64,
        seed=7,
        mix=defaults.mix_shards,
    )
    plan = StreamSpec(sources=[source], window=defaults.shuffle_window, seed=7)
    batch, open_shards = 64, min(defaults.mix_shards, 32)
    # Expected distinct shards in a batch drawn evenly from the open shards: S * (1 - (1 - 1/S)^B).
    even = open_shards * (1 - (1 - 1 / open_shards) ** batch)
    distinct = _distinct_shards_per_batch(plan, batch)
    assert len(distinct) >= 100, "the corpus should give a hundred batches of 64 per epoch"
    assert min(distinct) >= 20 and np.mean(distinct) >= 0.9 * even, (min(distinct), np.mean(distinct), even)
    # Shard after shard (mix 1, the order before mixing) fails the same bound.
    source.mix = 1
    assert np.mean(_distinct_shards_per_batch(plan, batch)) < 0.5 * even
