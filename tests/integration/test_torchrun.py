"""The per-rank loop without Ray: real torchrun, real gloo process groups.

Parity: the same model, data and seed give the same losses on 1 process and on 2 FSDP
processes at the same global batch; a stopped run resumes where it stopped.
"""

import json
import statistics

import pytest
from helpers import losses, torchrun_records


@pytest.fixture
def base(overrides):
    return [o for o in overrides if not o.startswith("run.dir=")] + [
        "train.max_steps=6",
        "train.log_every=1",
        "train.val_every=3",
        "train.checkpoint_every=3",
        "tracking.enabled=false",
        "cluster.use_gpu=false",
    ]


def test_one_and_two_fsdp_processes_give_the_same_losses(base, tmp_path):
    one_records = torchrun_records(1, [*base, f"run.dir={tmp_path / 'one'}"])
    # Rank 1 is starved of data for 0.3 s a step: the logged wait names it, and the losses do not move.
    two_records = torchrun_records(2, [*base, f"run.dir={tmp_path / 'two'}"], env={"RAYLLM_FAULT_SLOW_DATA": "1:0.3"})
    one, two = losses(one_records), losses(two_records)
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for r in one_records:
        if r["kind"] == "train":
            assert r["data_wait_max_rank"] == 0 and r["data_wait_max_frac"] == pytest.approx(r["data_wait_frac"])
    for r in two_records:
        if r["kind"] == "train" and r["step"] >= 2:  # past the stream's start, where rank 0 waits too
            assert r["data_wait_max_rank"] == 1, r
            assert r["data_wait_max_frac"] >= 0.3 / r["step_time_s"] - 0.01, r
            assert r["data_wait_frac"] < 0.75 * r["data_wait_max_frac"], r  # rank 0 barely waits
    for step in one:
        assert abs(one[step] - two[step]) / one[step] <= 1e-4, (step, one[step], two[step])
    assert one[6] < one[1]
    # A starved rank is not a straggler (its own step time leaves its data wait out): no false alarm.
    assert not any(r.get("stragglers") for r in two_records if r["kind"] == "train"), two_records
    assert "straggler" not in two_records[-1]["stdout"]
    # Validation rows packed by rank 0 and broadcast: the same validation loss as one process.
    val_one, val_two = (
        {r["step"]: r["val_loss"] for r in rs if r["kind"] == "val"} for rs in (one_records, two_records)
    )
    assert sorted(val_one) == sorted(val_two) and len(val_one) >= 2, (val_one, val_two)
    for step, loss in val_one.items():
        assert abs(loss - val_two[step]) / loss <= 1e-4, (step, loss, val_two[step])


def test_stopped_run_resumes_at_its_step_and_matches(base, tmp_path):
    full = losses(torchrun_records(2, [*base, f"run.dir={tmp_path / 'full'}"]))
    first = torchrun_records(2, [*base, f"run.dir={tmp_path / 'split'}", "train.stop_at_step=3"])
    assert max(losses(first)) == 3
    records = torchrun_records(1, [*base, f"run.dir={tmp_path / 'split'}"])  # resumed on a different world size
    starts = [r for r in records if r["kind"] == "start"]
    assert starts[-1]["step"] == 3
    resumed = losses(records[records.index(starts[-1]) :])
    assert sorted(resumed) == [4, 5, 6]
    assert abs(resumed[6] - full[6]) / full[6] <= 1e-4


def test_every_mth_checkpoint_is_kept_beside_the_last_k(base, tmp_path):
    run_dir = tmp_path / "run"
    torchrun_records(
        1,
        [
            *base,
            f"run.dir={run_dir}",
            "train.max_steps=8",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=1",
            "train.keep_checkpoint_every=4",
        ],
    )
    assert [p.name for p in run_dir.glob("checkpoint_*")] == ["checkpoint_00000008"]
    assert sorted(p.name for p in run_dir.glob("kept/*")) == ["checkpoint_00000004", "checkpoint_00000008"]
    assert json.loads((run_dir / "kept" / "checkpoint_00000004" / "train_state.json").read_text())["step"] == 4


def test_four_ranks_train_on_each_sequence_once_in_the_seed_order_through_4_2_4(overrides, tmp_path):
    """Exactly once under torchrun: ids recorded with each checkpoint through stops that change the
    world size (4 -> 2 -> 4 ranks) form the seed's global order, each sequence once, epoch 0 whole.

    On 2 ranks, rank 1 is slowed in every step: it is named as a straggler (progress line, metrics,
    Aim's per-rank context). On the last 4, rank 2 hangs inside a step: the watchdog writes every
    rank's stack, names rank 2 and ends the attempt; running again resumes from the checkpoint
    before the hang. (torchrun's own --max-restarts cannot restart gloo groups here: the
    restarted ranks' connectFullMesh is refused, torch 2.13, with any failure.)"""
    import glob

    import numpy as np

    from rayllm import TrainConfig
    from rayllm.data.discover import prepare_data
    from rayllm.data.order import local_stream

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    (tmp_path / "small").mkdir()
    for s in range(3):
        docs = [" ".join(words[(s * 7 + d * 3 + i) % 12] + str(i % 17) for i in range(160)) for d in range(6)]
        (tmp_path / "small" / f"part-{s}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    g = 8
    base = [o for o in overrides if not o.startswith(("data.train=", "data.val="))] + [
        f"data.train={tmp_path / 'small'}",
        "data.val=null",
        "data.record_ids=true",
        "data.shuffle_window=64",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1000",
        "train.log_every=1",
        "train.straggler_windows=2",
        "train.hang_timeout_s=3",
        "tracking.enabled=false",
        "cluster.use_gpu=false",
    ]
    plan = prepare_data(TrainConfig.from_yaml("configs/tiny.yaml", overrides=base), log=lambda *_: None).train
    batches = []
    for rows, _ in local_stream(plan, global_batch=g):
        batches.append(rows)
        if (rows["epoch"] > 0).all():
            break
    stream = np.concatenate(batches)
    steps = int(np.flatnonzero(stream["epoch"] == 0)[-1]) // g + 1
    assert steps >= 12
    ids = stream[["source", "epoch", "shard", "index"]].tolist()
    expected = [tuple(int(v) for v in r) for r in ids[: steps * g]]
    hang_marker = tmp_path / "hung"
    legs = [  # (ranks, stop at, overrides, environment, the attempt fails)
        (4, 4, [], {}, False),
        (2, 8, ["tracking.enabled=true"], {"RAYLLM_FAULT_SLOW_STEP": "1:0.25"}, False),
        (4, steps, [], {"RAYLLM_FAULT_HANG_AT": f"10:2:{hang_marker}"}, True),
        (4, steps, [], {}, False),
    ]
    outputs = []
    for nproc, stop, extra, env, fails in legs:
        records = torchrun_records(
            nproc, [*base, f"train.max_steps={steps}", f"train.stop_at_step={stop}", *extra], env, fails
        )
        assert max(losses(records)) == (9 if fails else stop)
        outputs.append(records)
    check_straggler_named(leg(outputs[1]), tmp_path / "run")
    check_hang_named(leg(outputs[2]), tmp_path / "run", hang_marker)
    assert [r["step"] for r in outputs[3] if r["kind"] == "start"][-1] == 8  # resumed before the hang
    seen = []
    for ckpt in sorted(glob.glob(str(tmp_path / "run" / "checkpoint_[0-9]*"))):
        per_rank = [np.load(p) for p in sorted(glob.glob(f"{ckpt}/consumed-rank*.npy"))]
        per_step = g // len(per_rank)
        for step in range(len(per_rank[0]) // per_step):
            for rows in per_rank:
                seen.extend(tuple(int(v) for v in r) for r in rows[step * per_step : (step + 1) * per_step].tolist())
    assert len(seen) == len(set(seen)), "a sequence was trained on twice"
    assert seen == expected


def leg(records: list[dict]) -> list[dict]:
    """The records of the last command only (metrics.jsonl holds every earlier one too)."""
    first = max(i for i, r in enumerate(records) if r["kind"] == "start")
    return records[first:]


def check_straggler_named(records: list[dict], run_dir) -> None:
    """Rank 1 (slowed by 0.25 s a step) named from its second window on, on the progress line
    too; Aim holds each rank's own step time under its rank."""
    from aim import Repo

    named = [r["stragglers"] for r in records if r["kind"] == "train" and r.get("stragglers")]
    assert named and all([s["rank"] for s in n] == [1] for n in named), records
    assert all(s["x_median"] > 1.5 and s["node"] for n in named for s in n), named
    assert "straggler: rank 1 on node" in records[-1]["stdout"]
    repo = Repo(str(run_dir / "aim"))
    own = {}
    for run in repo.iter_runs():
        for metric in run.metrics():
            if metric.name == "own_step_time_s":
                own.setdefault(metric.context.to_dict()["rank"], []).extend(metric.values.values_list())
    assert set(own) == {"0", "1"}, own
    assert statistics.median(own["1"]) > statistics.median(own["0"]) + 0.15, own


def check_hang_named(records: list[dict], run_dir, marker) -> None:
    """The hang in step 10 on rank 2: detected, every rank's stack written, rank 2 named in one line."""
    assert marker.exists(), "the hang was not injected"
    folder = run_dir / "hangs" / "attempt-1"
    summary = (folder / "summary.txt").read_text()
    assert "rank 2 on node" in summary and "maybe_hang" in summary and "did not reach the end of step 10" in summary
    assert "ranks 0, 1, 3 waited for it" in summary, summary
    issued = {}
    for rank in range(4):
        dump = (folder / f"rank-{rank}.txt").read_text()
        assert "Thread" in dump and ("maybe_hang" in dump) == (rank == 2), dump[:2000]
        issued[rank] = json.loads(dump.split("\n", 1)[0])["issued"]["0"]  # the world group's, from torch's recorder
    # Rank 2 never issued the collective the others wait in: the count that names it on NCCL too.
    assert issued[2] < issued[0] == issued[1] == issued[3], issued
    failures = [r for r in records if r["kind"] == "failure"]
    assert failures and "hang: no step finished" in failures[0]["message"], records
    assert "attempt failed at step 9 on rank 0" in records[-1]["stdout"]
