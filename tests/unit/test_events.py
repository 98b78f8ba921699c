"""The run's events (rayllm/events.py): each kind's record has the keys metrics.jsonl has always had,
in their order, and reads back to the same event; the driver's monitor has a handler for every kind
and prints and logs each as it always has."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import types

import numpy as np
import pytest
import torch

from rayllm import TrainConfig, events
from rayllm.loop.metrics import MetricWindow, PeakFlops
from rayllm.runtime.monitor import RunMonitor

# MetricWindow.summary's keys, in its order (loop/metrics.py): every train record has them.
TRAIN_KEYS = [
    *("step", "loss", "perplexity", "lr", "grad_norm", "tokens", "tokens_per_s", "tokens_per_s_per_worker"),
    *("flops_per_s", "mfu", "mfu_measured", "step_time_s", "data_wait_frac", "data_wait_max_frac"),
    "data_wait_max_rank",
    *("rank_own_step_s", "rank_data_wait_s", "rank_collective_wait_s", "peak_memory_bytes", "peak_reserved_bytes"),
    *("alloc_retries", "world_size"),
    *("restarts", "skipped_shards"),
]
# Each kind's keys after "kind", as its emitter wrote them before events were typed.
KEYS = {
    "start": [
        *("step", "world_size", "params", "flops_per_token", "peak_flops", "published_peak_flops", "restarts"),
        "resumed_from",
        *("accum_steps", "layout", "nodes"),
    ],  # trainer.py
    "train": [*TRAIN_KEYS, "mixture"],  # trainer.py: **metrics (val_loss too, once validated), mixture
    "val": ["step", "val_loss"],  # trainer.py
    "samples": ["step", "samples"],  # trainer.py
    "checkpoint": ["step", "stall_s", "final"],  # checkpointer.py
    "memory_checkpoint": ["step", "stall_s", "bytes", "write_s"],  # checkpointer.py
    "kept": ["step", "uri"],  # checkpointer.py
    "warning": ["step", "message"],  # checkpointer.py
    "failure": ["step", "rank", "node", "message"],  # watchdog.py, ray_worker.py; the final one below
    "preempted": ["step", "rank"],  # trainer.py
    "nonfinite": ["step", "loss", "grad_norm", "in_row"],  # trainer.py
    "stopped": ["step"],  # trainer.py
    "first_step": ["step", "phases", "stream_kept"],  # trainer.py
    "skipped": ["step", "shards"],  # trainer.py
    "data_changed": ["step", "checkpoint", "changes", "restarted", "kept"],  # data_resume.py (a new event)
    "dropped": ["step", "records"],  # trainer.py
    "done": ["step"],  # trainer.py: step, **the last checkpoint's metrics
    "resize": ["step", "from", "to"],  # monitor.py
}
TRAIN = dict(
    zip(TRAIN_KEYS, [20, 4.5, 90.0, 1e-3, 0.75, 40960, 2048.0, 1024.0, 1e9, 0.25, 0.2, 0.5, 0.1, 0.2, 1], strict=False)
)
TRAIN.update(
    rank_own_step_s=[0.4, 0.41],
    rank_data_wait_s=[0.05, 0.1],
    rank_collective_wait_s=[0.05, 0.0],
    peak_memory_bytes=2**30,
    peak_reserved_bytes=None,
    alloc_retries=None,
    world_size=2,
    restarts=1,
    skipped_shards=0,
)
SHARD = {"source": 0, "epoch": 0, "shard": 3, "name": "demo", "uri": "data/demo/train/shard-3", "error": "bad"}
START = events.Start(
    step=0,
    world_size=2,
    params=5_000_000,
    flops_per_token=3.1e7,
    peak_flops=2e12,
    restarts=0,
    resumed_from=None,
    accum_steps=2,
    layout="FSDP 2",
    nodes=["node-a", "node-b"],
)
# (an event as its emitter builds it, the keys its record has beyond KEYS[kind])
CASES = [
    (START, []),
    (events.Train.from_metrics(TRAIN, {"demo": 1.0}), []),
    (events.Train.from_metrics({**TRAIN, "val_loss": 4.4}, {"a": 0.5, "b": 0.5}), ["val_loss"]),
    (events.Val(step=0, val_loss=5.5), []),
    (events.Samples(step=20, samples=[{"prompt": "def ", "text": "def f():"}]), []),
    (events.Checkpoint(step=20, stall_s=0.03, final=False), []),
    (events.MemoryCheckpoint(step=5, stall_s=0.01, nbytes=3 * 2**20 // 2), []),
    (events.Kept(step=20, uri="/runs/r/kept/step_20"), []),
    (events.RunWarning(step=20, message="checkpoint housekeeping: gone"), []),
    (events.Failure(step=7, rank=1, node="node-b", message="RuntimeError: boom"), []),
    (events.Preempted(step=12, rank=1), []),
    (events.NonFinite(step=9, loss=float("nan"), grad_norm=float("inf"), in_row=2), []),
    (events.Stopped(step=12), []),
    (events.FirstStep(step=1, phases={"model": 1.0, "batch": 2.0}, stream_kept=None), []),
    (events.Skipped(step=3, shards=[SHARD]), []),
    (
        events.DataChanged(
            step=10, checkpoint="checkpoint_00000010", changes=["data.seq_len 256 -> 512"], restarted=["a"], kept=[]
        ),
        [],
    ),
    (events.Dropped(step=3, records={"demo": {"not_text": 2, "too_long": 1}}), []),
    (events.Done(step=0), []),  # max_steps 0: no checkpoint, no metrics
    (events.Done(step=20, metrics={**TRAIN, "val_loss": 4.4}), [*TRAIN_KEYS[1:], "val_loss"]),
    (events.Done(step=25, metrics={**TRAIN, "val_loss": 4.4}), [*TRAIN_KEYS[1:], "val_loss"]),  # logged at 20
    (events.Resize(step=12, from_workers=2, to_workers=1), []),
]


def _json(value) -> str:  # NaN as JSON writes it (NaN != NaN)
    return json.dumps(value)


def test_every_kind_has_an_event_and_a_case():
    assert set(events.KINDS) == set(KEYS) and len(events.EVENTS) == len(KEYS) == 18
    assert {event.kind for event, _ in CASES} == set(KEYS)


@pytest.mark.parametrize("event, extra", CASES, ids=[f"{e.kind}-{i}" for i, (e, _) in enumerate(CASES)])
def test_each_record_has_the_keys_it_always_had_and_reads_back(event, extra):
    record, keys = event.to_record(), KEYS[event.kind]
    assert list(record) == ["kind", *(keys[:-1] + extra + keys[-1:] if event.kind == "train" else keys + extra)]
    back = events.from_record(record)
    assert type(back) is type(event) and _json(dataclasses.asdict(back)) == _json(dataclasses.asdict(event))
    assert _json(events.from_record(json.loads(_json(record))).to_record()) == _json(record)  # as JSON


def test_a_failure_leaves_out_what_its_emitter_does_not_know():
    final = events.Failure(step=7, rank=1, message="rank 1 failed the same way", final=True)  # ray_worker.py
    assert list(final.to_record()) == ["kind", "step", "rank", "message", "final"]
    assert events.from_record(final.to_record()) == final


def test_done_says_the_step_its_metrics_were_logged_at_as_it_always_did():
    last_metrics = {**TRAIN, "val_loss": 4.4}  # logged at step 20, checkpointed at 25
    record = events.Done(step=25, metrics=last_metrics).to_record()
    assert _json(record) == _json({"kind": "done", "step": 25, **last_metrics})  # the trainer's dict before
    assert record["step"] == 20 and "step" in last_metrics


def test_a_record_that_fits_no_event_is_refused():
    with pytest.raises(ValueError, match="no run event of kind 'nope'"):
        events.from_record({"kind": "nope", "step": 1})
    with pytest.raises(ValueError, match="no event field holds"):
        events.from_record({"kind": "val", "step": 1, "val_loss": 2.0, "extra": 1})
    with pytest.raises(TypeError):
        events.from_record({"kind": "val", "step": 1})
    with pytest.raises(TypeError):
        events.Train.from_metrics({"step": 1, "loss": 2.0}, {})


def test_the_train_event_holds_what_the_metric_window_makes():
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=["tracking.enabled=false"])
    sources = types.SimpleNamespace(sources=[types.SimpleNamespace(name="a"), types.SimpleNamespace(name="b")])
    session = types.SimpleNamespace(world_size=1, device=torch.device("cpu"), train_spec=sources)
    window = MetricWindow(config, session, 1e6, PeakFlops(1e12), 0, np.zeros(2, dtype=np.int64))
    window.add(3.0, 1.0)
    counts = np.array([3, 1])
    metrics, mixture = window.summary(step=1, lr=1e-3, tokens=64, skipped_shards=0, counts=counts, collective_frac=0.0)
    assert list(metrics) == TRAIN_KEYS
    event = events.Train.from_metrics(metrics, mixture)
    assert event.to_record() == {"kind": "train", **metrics, "mixture": mixture} and event.metrics == {}


def test_the_monitor_has_a_handler_for_every_kind():
    missing = [e.kind for e in events.EVENTS if e not in RunMonitor.HANDLERS]
    assert not missing, f"kinds the monitor does not handle: {missing}"
    assert set(RunMonitor.HANDLERS) == set(events.EVENTS)


# What the monitor printed for SENT before events were typed (its if/elif on dicts), to the byte.
SLOW = {**TRAIN, "step": 10, "rank_own_step_s": [0.1, 0.5]}  # rank 1, three windows in a row
SENT = [
    START,
    events.Val(step=0, val_loss=5.5),
    events.FirstStep(step=1, phases={"model": 1.0, "batch": 2.0}, stream_kept=None),
    *[events.Train.from_metrics(SLOW, {"demo": 1.0})] * 3,
    events.Skipped(step=3, shards=[SHARD]),
    events.NonFinite(step=9, loss=float("nan"), grad_norm=float("inf"), in_row=2),
    events.Checkpoint(step=10, stall_s=0.03, final=False),
    events.Kept(step=10, uri="/runs/r/kept/step_10"),
    events.RunWarning(step=10, message="checkpoint housekeeping: gone"),
    events.MemoryCheckpoint(step=15, stall_s=0.01, nbytes=3 * 2**20 // 2),
    events.Train.from_metrics({**TRAIN, "val_loss": 4.4}, {"a": 0.5, "b": 0.5}),
    events.Val(step=20, val_loss=4.4),
    events.Samples(step=20, samples=[{"prompt": "def ", "text": "def f():"}]),
    events.Preempted(step=12, rank=1),
    events.Failure(step=7, rank=1, node="node-b", message="RuntimeError: boom"),
    dataclasses.replace(START, step=12, world_size=1, nodes=["node-a"], restarts=1, resumed_from="memory"),
    events.Failure(step=12, rank=0, message="rank 0 failed the same way", final=True),
    dataclasses.replace(START, step=12, restarts=2, resumed_from="storage"),
    events.Stopped(step=14),
    events.Done(step=20, metrics={**TRAIN, "val_loss": 4.25}),
]
STEP = "[rayllm] step {}/20 | loss 4.5000 | lr 1.00e-03 | grad 0.75 | 2,048 tok/s | MFU 25.0% | ETA {}"
PRINTED = [
    "[rayllm] starting at step 0 on 2 worker(s), 5.0M parameters, 2 micro-batch(es) per worker per step",
    "[rayllm] MFU is against the matmul peak measured at the start, 1 TFLOP/s per worker; FLOPs per token 6N + 12LdT",
    "[rayllm] step 0 | val loss 5.5000",
    STEP.format(10, "0m05s"),
    STEP.format(10, "0m05s"),
    STEP.format(10, "0m05s") + " | straggler: rank 1 on node node-b (1.7x the median step)",
    STEP.format(20, "0m00s") + " | in memory 1.5 MiB",
    "[rayllm] step 20 | val loss 4.4000",
    "[rayllm] rank 1 was asked to stop (SIGTERM or a preemption notice): checkpointed at step 12; "
    "restarting from there",
    "[rayllm] attempt failed at step 7 on rank 1 on node node-b: RuntimeError: boom; "
    "restarting from the latest checkpoint",
    "[rayllm] resized from 2 to 1 worker(s) at step 12; the global batch stays 16",
    "[rayllm] resuming at step 12 (from the in-memory checkpoint) on 1 worker(s), 5.0M parameters, "
    "2 micro-batch(es) per worker per step",
    "[rayllm] attempt failed at step 12 on rank 0: rank 0 failed the same way; the run ends",
    "[rayllm] resized from 1 to 2 worker(s) at step 12; the global batch stays 16",
    "[rayllm] resuming at step 12 on 2 worker(s), 5.0M parameters, 2 micro-batch(es) per worker per step",
    "[rayllm] stopped at step 14 with a checkpoint; running again resumes from it",
]
WARNED = [
    "[rayllm] warning: skipped shard data/demo/train/shard-3: bad",
    "[rayllm] warning: step 9 skipped: loss nan, gradient norm inf (2 in a row)",
    "[rayllm] warning at step 10: checkpoint housekeeping: gone",
]


def test_the_monitor_prints_and_logs_each_kind_as_it_always_has(tmp_path):
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml", overrides=[f"run.dir={tmp_path}", "tracking.enabled=false", "train.max_steps=20"]
    )
    out, err = io.StringIO(), io.StringIO()
    monitor = RunMonitor(config, out=out)
    with contextlib.redirect_stderr(err):
        for event in SENT:
            monitor.handle(event)
    monitor.close()
    assert out.getvalue().splitlines() == PRINTED
    assert err.getvalue().splitlines() == WARNED
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r.pop("time"), float) for r in logged)
    stragglers = [r.pop("stragglers") for r in logged if r["kind"] == "train"]
    assert stragglers == [[], [], [{"rank": 1, "node": "node-b", "x_median": pytest.approx(5 / 3)}], []]
    resizes = [
        events.Resize(step=12, from_workers=2, to_workers=1),
        events.Resize(step=12, from_workers=1, to_workers=2),
    ]
    expected = [e.to_record() for e in SENT]
    expected[-4:-4] = [resizes[0].to_record()]  # after the start that resized
    expected[-2:-2] = [resizes[1].to_record()]
    assert _json(logged) == _json(expected)
    assert monitor.kept == ["/runs/r/kept/step_10"] and monitor.skipped == [SHARD]
    assert monitor.val_loss == 4.25 and monitor.initial_val_loss == 5.5 and monitor.first_step_at is not None
    assert monitor.mixture == {"a": 0.5, "b": 0.5} and monitor.memory_bytes == 3 * 2**20 // 2


def test_the_summary_times_the_first_step_from_the_start_and_each_restart_from_its_failure(tmp_path, monkeypatch):
    """A run whose first attempt hangs: "to the first step" is the first attempt's (20 s), not the last
    one's (160 s from the start); the restart is timed from the failure it followed (10 s)."""
    import rayllm.runtime.monitor as monitor_module
    from rayllm.runtime.launch import _summary, format_summary

    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=[f"run.dir={tmp_path}", "tracking.enabled=false"])
    monitor = RunMonitor(config, quiet=True)
    timeline = [
        (0.0, START),
        (20.0, events.FirstStep(step=1, phases={}, stream_kept=None)),
        (90.0, events.Train.from_metrics(TRAIN, {"demo": 1.0})),
        (150.0, events.Failure(step=20, rank=0, message="rank 0 made no step for 60 s (hang)")),
        (155.0, dataclasses.replace(START, step=20, restarts=1, resumed_from="storage")),
        (160.0, events.FirstStep(step=21, phases={}, stream_kept=False)),
    ]
    for at, event in timeline:
        monkeypatch.setattr(monitor_module.time, "time", lambda at=at: 1000.0 + at)
        monitor.handle(event)
    monkeypatch.undo()
    monitor.close()
    result = types.SimpleNamespace(metrics={"step": 30}, checkpoint=None)
    summary = _summary(config, result, monitor, types.SimpleNamespace(name=None), started=1000.0)
    assert summary.seconds_to_first_step == 20.0
    assert [(t.step, t.seconds_to_first_step) for t in summary.restarts] == [(20, 10.0)]
    text = format_summary(summary)
    assert "(20 s to the first step)" in text
    assert "restarts        1; from each failure to the next step: 10 s (resumed at step 20)" in text
