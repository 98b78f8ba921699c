"""Planning at scale: a corpus of 100,000 shards is listed, planned and served from a resumed
position in seconds, because sizes come from one listing and no step rebuilds a whole epoch."""

import json
import time

import pytest

from rayllm import TrainConfig
from rayllm.data.discover import prepare_data
from rayllm.data.order import DataState, local_stream
from rayllm.data.shard_groups import groups_per_epoch

SHARDS = 100_000
BOUND_S = 30.0  # generous for a loaded 2-core CI machine; the figure on this machine goes in docs/data.md


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    line = json.dumps({"text": "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 3}) + "\n"
    for i in range(SHARDS):
        (root / f"part-{i:06d}.jsonl").write_text(line)
    return root


def test_100k_shards_plan_and_serve_a_resumed_batch_in_seconds(many_shards, tokenizer_file, tmp_path):
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[
            f"data.train={many_shards}",
            "data.val=null",
            f"data.tokenizer={tokenizer_file}",
            "data.seq_len=16",
            "data.demo_corpus=false",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    started = time.perf_counter()
    plans = prepare_data(config, log=lambda *_: None)
    planned = time.perf_counter() - started
    source = plans.train.sources[0]
    assert len(source.shards) == SHARDS and len(source.sizes) == SHARDS and min(source.sizes) > 0
    # A run resumed deep in its sixth epoch: its cursor names a group, nothing before it is replayed.
    group = 5 * groups_per_epoch(source) + 17
    state = DataState(position=0, cursors=[[group, [None] * source.mix]])
    rows, _ = next(local_stream(plans.train, state, global_batch=config.train.global_batch_size))
    served = time.perf_counter() - started
    assert set(rows["epoch"].tolist()) == {5} and len(set(rows["shard"].tolist())) > 1
    print(f"100k shards: planned in {planned:.2f} s, first resumed batch after {served:.2f} s")
    assert served < BOUND_S, f"planning took {planned:.1f} s and serving the first batch {served:.1f} s"
