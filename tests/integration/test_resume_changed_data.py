"""A resume on data other than its checkpoint's, under real torchrun (one process): sources listed in
another order are no change (the same sequences follow); shards added to a source and a changed
data.seq_len are refused in one line naming both; with data.on_change=restart the run goes on, says
what restarted, and trains the new order from its start with the unchanged source where it was."""

from __future__ import annotations

import json

import numpy as np
from helpers import TEST_MODEL, torchrun_records

from rayllm import TrainConfig
from rayllm.data.discover import prepare_data
from rayllm.data.fingerprint import align, fingerprint
from rayllm.data.order import DataState, local_stream

G = 8
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def write_shards(folder, count: int, first: int = 0) -> None:
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(first + len(folder.name))
    for s in range(first, first + count):
        docs = [" ".join(rng.choice(WORDS, size=200)) for _ in range(12)]
        (folder / f"part-{s:03d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def overrides(tmp_path, tokenizer_file, sources: tuple[str, ...], *extra: str) -> list[str]:
    mixture = ", ".join(f"{{path: {tmp_path / name}, name: {name}}}" for name in sources)
    return [
        *TEST_MODEL,
        f"data.train=[{mixture}]",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        "data.shuffle_window=16",
        "data.record_ids=true",
        f"run.dir={tmp_path / 'run'}",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=10",
        "train.log_every=1",
        "train.sample_tokens=0",
        "tracking.enabled=false",
        *extra,
    ]


def step_ids(tmp_path, step: int) -> list[tuple[int, ...]]:
    """The ids of the sequences the checkpoint of ``step`` recorded (those since the one before)."""
    (path,) = (tmp_path / "run" / f"checkpoint_{step:08d}").glob("consumed-rank*.npy")  # one rank
    rows = np.load(path)
    return [tuple(int(v) for v in r) for r in rows.tolist()]


def ids(rows) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in r) for r in rows[["source", "epoch", "shard", "index"]].tolist()]


def test_changed_data_is_refused_naming_it_or_restarted_by_choice(tokenizer_file, tmp_path):
    write_shards(tmp_path / "code", 3)
    write_shards(tmp_path / "web", 2)
    base = overrides(tmp_path, tokenizer_file, ("code", "web"))
    plan = prepare_data(TrainConfig.from_yaml("configs/tiny.yaml", overrides=base), log=lambda *_: None).train
    first_order = [ids(rows) for _, (rows, _) in zip(range(3), local_stream(plan, global_batch=G), strict=False)]
    torchrun_records(1, [*base, "train.stop_at_step=2"])

    # The sources listed the other way round: no change; step 3 trains the sequences the first order had there.
    swapped = torchrun_records(1, [*overrides(tmp_path, tokenizer_file, ("web", "code")), "train.stop_at_step=3"])
    assert "lists its sources in another order than checkpoint_00000002" in swapped[-1]["stdout"]
    assert not [r for r in swapped if r["kind"] == "data_changed"]
    assert step_ids(tmp_path, 3) == first_order[2]

    write_shards(tmp_path / "code", 2, first=3)
    refused = torchrun_records(1, [*base, "data.seq_len=32"], fails=True)
    assert (
        "rayllm: error: data changed since checkpoint_00000003: data.seq_len 64 -> 32, source 'code' has 2 shards "
        "more (3 -> 5); to start the changed parts' order afresh set data.on_change=restart"
    ) in refused[-1]["stderr"]
    assert not (tmp_path / "run" / "checkpoint_00000004").exists()

    restarted = torchrun_records(1, [*base, "data.on_change=restart"])
    assert (
        "[rayllm] data changed since checkpoint_00000003: source 'code' has 2 shards more (3 -> 5); "
        "data.on_change=restart: a new data order starts at step 3, 'code' from the beginning, 'web' where they were"
    ) in restarted[-1]["stdout"]
    changed = [r for r in restarted if r["kind"] == "data_changed"]
    assert [(r["step"], r["restarted"], r["kept"]) for r in changed] == [(3, ["code"], ["web"])]
    assert max(r["step"] for r in restarted if r["kind"] == "train") == 4
    # Step 4 is the new order's first batch: 'code' (5 shards now) from its start, 'web' from the checkpoint's cursor.
    saved = json.loads((tmp_path / "run" / "checkpoint_00000003" / "train_state.json").read_text())
    now = prepare_data(TrainConfig.from_yaml("configs/tiny.yaml", overrides=base), log=lambda *_: None).train
    now = align(now, fingerprint(plan))
    state = DataState(0, [None, saved["data"]["cursors"][1]])
    first_new = next(iter(local_stream(now, state, global_batch=G)))[0]
    assert step_ids(tmp_path, 4) == ids(first_new)
