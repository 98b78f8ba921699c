"""A resume's data against its checkpoint's (rayllm/data/fingerprint.py, rayllm/loop/data_resume.py), on
real discovered plans of generated shards and real checkpoint folders: a change is named, refused by default
or restarted by choice; a reorder is no change; an old checkpoint resumes unchecked."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from helpers import TEST_MODEL

from rayllm import events
from rayllm.checkpoint.state import TrainState
from rayllm.checkpoint.store import CheckpointStore
from rayllm.config import TrainConfig
from rayllm.data.discover import prepare_data
from rayllm.data.fingerprint import DataFingerprint, align, compare, fingerprint, is_reordered
from rayllm.data.order import DataState, local_stream
from rayllm.data.shard_groups import group_members
from rayllm.errors import DataError
from rayllm.loop.data_resume import check_resume_data, resume_data

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def write_shards(folder, count: int, first: int = 0, seed: int = 0) -> None:
    """``count`` small jsonl shards (numbered from ``first``), each a few dozen 65-token sequences."""
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed + first)
    for s in range(first, first + count):
        docs = [" ".join(rng.choice(WORDS, size=200)) for _ in range(12)]
        (folder / f"part-{s:03d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


@pytest.fixture
def folders(tmp_path):
    for name, count in (("code", 3), ("web", 2), ("books", 2)):
        write_shards(tmp_path / name, count, seed=len(name))
    return tmp_path


def config_of(folders, tokenizer_file, sources=("code", "web"), *extra: str) -> TrainConfig:
    mixture = ", ".join(f"{{path: {folders / name}, name: {name}, weight: 1}}" for name in sources)
    overrides = [
        *TEST_MODEL,
        f"data.train=[{mixture}]",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        "data.shuffle_window=16",
        f"run.dir={folders / 'run'}",
        *extra,
    ]
    return TrainConfig.from_yaml("configs/tiny.yaml", overrides=overrides)


def plans_of(config: TrainConfig):
    return prepare_data(config, log=lambda *_: None)


def committed(config: TrainConfig, step: int, fp: DataFingerprint | None, data: DataState | None = None) -> str:
    """A committed checkpoint folder at ``step`` holding only its train state (what the check reads)."""
    store = CheckpointStore(config.run.dir, config.storage)
    state = TrainState(step=step, consumed=8 * step, data=data or DataState(), data_fingerprint=fp)
    store.write_state(step, state, tokenizer_json=None)
    store.mark_complete(step, world_size=1)
    return store.uri(step)


def test_the_same_data_is_no_change_and_the_fingerprint_survives_the_checkpoint_json(folders, tokenizer_file):
    config = config_of(folders, tokenizer_file)
    fp = fingerprint(plans_of(config).train)
    assert fingerprint(plans_of(config).train) == fp and not compare(fp, fp)
    state = TrainState(step=1, consumed=8, data_fingerprint=fp, data_origin=8)
    assert TrainState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_reordered_sources_keep_the_checkpoints_order_and_give_the_same_stream(folders, tokenizer_file):
    saved_plan = plans_of(config_of(folders, tokenizer_file, ("code", "web"))).train
    saved = fingerprint(saved_plan)
    swapped = plans_of(config_of(folders, tokenizer_file, ("web", "code"))).train
    assert is_reordered(swapped, saved)
    assert compare(saved, fingerprint(swapped)).changes == ()  # matched by name: the reorder is no change
    aligned = align(swapped, saved)
    assert fingerprint(aligned) == saved
    first = [rows for _, (rows, _) in zip(range(4), local_stream(saved_plan, global_batch=8), strict=False)]
    again = [rows for _, (rows, _) in zip(range(4), local_stream(aligned, global_batch=8), strict=False)]
    assert all((a == b).all() for a, b in zip(first, again, strict=True))


def test_added_shards_and_a_changed_seq_len_are_refused_in_one_line_naming_both(folders, tokenizer_file):
    config = config_of(folders, tokenizer_file)
    committed(config, 10, fingerprint(plans_of(config).train))
    write_shards(folders / "code", 2, first=3)
    changed = config_of(folders, tokenizer_file, ("code", "web"), "data.seq_len=32")
    with pytest.raises(DataError) as refused:
        check_resume_data(changed, plans_of(changed), log=print)
    assert str(refused.value) == (
        "data changed since checkpoint_00000010: data.seq_len 64 -> 32, source 'code' has 2 shards more (3 -> 5); "
        "to start the changed parts' order afresh set data.on_change=restart (or resume with the data the "
        "checkpoint was trained on)"
    )
    restart = config_of(folders, tokenizer_file, ("code", "web"), "data.seq_len=32", "data.on_change=restart")
    assert check_resume_data(restart, plans_of(restart), log=print).train.sources[0].seq_len == 32


def test_a_tokenizer_of_the_same_vocabulary_size_is_refused_and_leaves_the_run_copy(folders, tokenizer_file, tmp_path):
    config = config_of(folders, tokenizer_file)
    first = plans_of(config)
    committed(config, 4, fingerprint(first.train))
    raw = json.loads(tokenizer_file.read_text())  # the same tokens, two of them swapped: another tokenizer
    vocab = raw["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    other = tmp_path / "other-tokenizer.json"
    other.write_text(json.dumps(raw))
    changed = config_of(folders, tokenizer_file, ("code", "web"), f"data.tokenizer={other}")
    plans = plans_of(changed)
    assert plans.vocab_size == first.vocab_size
    with pytest.raises(DataError, match=r"since checkpoint_00000004: data.tokenizer is another tokenizer"):
        check_resume_data(changed, plans, log=print)
    assert (folders / "run" / "tokenizer.json").read_text() == tokenizer_file.read_text()  # the run's own


def test_a_removed_source_is_named_and_the_others_keep_their_shard_order(folders, tokenizer_file):
    saved_plan = plans_of(config_of(folders, tokenizer_file, ("code", "web", "books"))).train
    saved = fingerprint(saved_plan)
    now = align(plans_of(config_of(folders, tokenizer_file, ("code", "books"))).train, saved)
    changes = compare(saved, fingerprint(now))
    assert changes.changes == ("source 'web' removed",) and not changes.sources and not changes.everything
    heavier = dataclasses.replace(now, sources=[dataclasses.replace(now.sources[0], weight=3.0), now.sources[1]])
    assert compare(saved, fingerprint(heavier)).changes[1:] == ("source 'code' weight 1 -> 3",)
    books_then, books_now = saved_plan.sources[2], now.sources[1]
    assert [group_members(books_now, g) for g in range(4)] == [group_members(books_then, g) for g in range(4)]


def test_restart_keeps_the_unchanged_sources_cursors_and_starts_a_new_order(folders, tokenizer_file):
    config = config_of(folders, tokenizer_file)
    saved = fingerprint(plans_of(config).train)
    cursors = [[0, [[5, 1, 0]]], [1, [[7, 2, 10]]]]
    state = TrainState(step=6, consumed=48, data=DataState(32, cursors), source_counts=[30, 18], data_fingerprint=saved)
    write_shards(folders / "code", 1, first=3)
    now = fingerprint(plans_of(config).train)
    told: list[events.RunEvent] = []
    with pytest.raises(DataError, match=r"since checkpoint_00000006: source 'code' has 1 shard more \(3 -> 4\)"):
        resume_data(state, now, "refuse", str(folders / "run" / "checkpoint_00000006"), told.append)
    resumed = resume_data(state, now, "restart", str(folders / "run" / "checkpoint_00000006"), told.append)
    assert resumed.data == DataState(0, [None, cursors[1]])  # 'code' from its start, 'web' where it was
    assert (resumed.data_origin, resumed.source_counts, resumed.step) == (48, [30, 18], 6)
    assert told == [
        events.DataChanged(
            step=6,
            checkpoint="checkpoint_00000006",
            changes=["source 'code' has 1 shard more (3 -> 4)"],
            restarted=["code"],
            kept=["web"],
        )
    ]
    # A change that moves every sequence (seq_len): no cursor is kept.
    longer = dataclasses.replace(now, seq_len=128)
    assert resume_data(state, longer, "restart", "checkpoint_00000006", told.append).data.cursors == [None, None]


def test_a_checkpoint_without_a_fingerprint_resumes_unchecked_saying_so_once(folders, tokenizer_file):
    config = config_of(folders, tokenizer_file)
    committed(config, 2, None)
    said: list[str] = []
    plans = check_resume_data(config, plans_of(config), log=said.append)
    assert said == [
        "checkpoint_00000002 predates data fingerprints: resuming without checking that the data is the one it "
        "was trained on"
    ]
    old = TrainState(step=2, consumed=16)
    assert resume_data(old, fingerprint(plans.train), "refuse", "checkpoint_00000002", said.append) is old
    shutil.rmtree(folders / "run")
    assert check_resume_data(config, plans, log=said.append) is plans and len(said) == 1  # a fresh run
