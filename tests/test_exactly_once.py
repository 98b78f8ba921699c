"""Exactly once, in one order: sequence ids recorded with each checkpoint through restarts
that change the number of workers (2 -> 1 -> 2) form the seed's global order, each once."""

import glob
import json

import numpy as np
import pytest

from rayllm import TrainConfig, train
from rayllm.data.pipeline import local_stream, window_shuffled
from rayllm.data.plan import prepare_data

pytestmark = pytest.mark.slow
G = 8


@pytest.fixture
def small_corpus(tmp_path):
    """About 190 sequences of 65 tokens in 3 shards, so a test can train through a whole epoch."""
    root = tmp_path / "small"
    root.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for s in range(3):
        with open(root / f"part-{s}.jsonl", "w") as f:
            for d in range(6):
                text = " ".join(words[(s * 7 + d * 3 + i) % len(words)] + str(i % 17) for i in range(160))
                f.write(json.dumps({"text": text}) + "\n")
    return root


def ids_of(rows):
    return [tuple(int(v) for v in r) for r in rows]


def test_ids_form_one_epoch_in_seed_order_through_2_1_2_workers(ray_local, overrides, small_corpus, tmp_path):
    base = [
        *overrides,
        f"data.train={small_corpus}",
        "data.val=null",
        "data.record_ids=true",
        "data.shuffle_window=64",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1000",
        "train.log_every=2",
        "tracking.enabled=false",
    ]
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=base)
    plan = prepare_data(config, log=lambda *_: None).train
    stream = np.concatenate(list(window_shuffled(lambda: local_stream(plan), 64, seed=config.train.seed)()))
    epoch0 = stream[stream["epoch"] == 0]
    steps = len(epoch0) // G
    assert steps >= 12, f"the small corpus should give at least 12 steps, got {steps}"
    expected = ids_of(stream[: steps * G][["epoch", "shard", "index"]])

    for workers, stop in ((2, 4), (1, 9), (2, steps)):
        result = train(
            TrainConfig.from_yaml(
                "configs/tiny.yaml",
                overrides=[
                    *base,
                    f"train.max_steps={steps}",
                    f"cluster.num_workers={workers}",
                    f"train.stop_at_step={stop}",
                ],
            ),
            quiet=True,
        )
        assert result.step == stop

    # Rebuild the global order: per checkpoint, per step, rank 0's rows then rank 1's.
    seen = []
    for ckpt in sorted(glob.glob(str(tmp_path / "run" / "checkpoint_[0-9]*"))):
        per_rank = [np.load(p) for p in sorted(glob.glob(f"{ckpt}/consumed-rank*.npy"))]
        world = len(per_rank)
        per_step = G // world
        for step in range(len(per_rank[0]) // per_step):
            for rows in per_rank:
                seen.extend(ids_of(rows[step * per_step : (step + 1) * per_step]))
    assert len(seen) == len(set(seen)), "a sequence was trained on twice"
    assert seen == expected  # every sequence of the epoch once, in the seed's order, whatever the world size
