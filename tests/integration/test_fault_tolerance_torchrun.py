"""Checkpoint atomicity and preemption under plain torchrun (real gloo process groups, no Ray):
a rank that dies after writing its shards but before the commit leaves resume on the previous
complete checkpoint; SIGTERM saves a checkpoint at the next step and the next start resumes there."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from helpers import losses, read_records, torchrun_cmd
from safetensors.torch import load_file

import rayllm
from rayllm.checkpoint import COMMIT_FILE
from rayllm.errors import CheckpointError

pytestmark = pytest.mark.slow


@pytest.fixture
def base(overrides):
    return [o for o in overrides if not o.startswith("run.dir=")] + [
        "train.max_steps=6",
        "train.log_every=1",
        "train.val_every=100",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=5",
        "tracking.enabled=false",
        "data.val=null",
    ]


def test_crash_between_write_and_commit_resumes_from_the_previous_checkpoint(base, tmp_path):
    full_dir, run_dir = tmp_path / "full", tmp_path / "crash"
    subprocess.run(torchrun_cmd(2, [*base, f"run.dir={full_dir}"]), check=True, capture_output=True, timeout=600)
    env = {**os.environ, "RAYLLM_FAULT_CRASH_BEFORE_COMMIT": f"4:{tmp_path / 'crashed'}"}
    crashed = subprocess.run(
        torchrun_cmd(2, [*base, f"run.dir={run_dir}"]), env=env, capture_output=True, text=True, timeout=600
    )
    assert crashed.returncode != 0
    names = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint_"))
    assert names == ["checkpoint_00000002", "checkpoint_00000004"]
    partial = run_dir / "checkpoint_00000004"
    assert (partial / "train_state.json").exists() and (partial / ".metadata").exists()  # rank 0's part is there
    assert not (partial / COMMIT_FILE).exists()  # ... but the checkpoint was never committed
    # Every reader takes the previous complete checkpoint: generate, export (and resume, below).
    assert rayllm.load(str(run_dir), device="cpu").step == 2
    with pytest.raises(CheckpointError, match="not a complete rayllm checkpoint"):
        rayllm.load(str(partial), device="cpu")
    exported = tmp_path / "hf"
    rayllm.export_hf(str(run_dir), str(exported))
    reference = rayllm.load(str(run_dir / "checkpoint_00000002"), device="cpu").model.state_dict()
    weights = load_file(str(exported / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], reference["output.weight"])
    subprocess.run(torchrun_cmd(2, [*base, f"run.dir={run_dir}"]), check=True, capture_output=True, timeout=600)
    recs = read_records(run_dir)
    starts = [r for r in recs if r["kind"] == "start"]
    assert [s["step"] for s in starts] == [0, 2]
    resumed = losses(recs[recs.index(starts[-1]) :])
    assert sorted(resumed) == [3, 4, 5, 6]
    full = losses(read_records(full_dir))
    assert abs(resumed[6] - full[6]) / full[6] <= 1e-4


def test_sigterm_saves_a_checkpoint_and_the_next_start_resumes_from_it(base, tmp_path):
    run_dir = tmp_path / "preempted"
    cmd = torchrun_cmd(2, [*base, f"run.dir={run_dir}", "train.max_steps=500", "train.checkpoint_every=1000"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if read_records(run_dir, "train"):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # what a spot notice or a scheduler sends
    out, err = proc.communicate(timeout=120)
    recs = read_records(run_dir)
    stopped = [r for r in recs if r["kind"] == "stopped"]
    assert len(stopped) == 1, out[-2000:] + err[-2000:]
    step = stopped[0]["step"]
    assert 1 <= step < 500
    assert (run_dir / f"checkpoint_{step:08d}" / "train_state.json").exists()
    resumed = subprocess.run(
        torchrun_cmd(2, [*base, f"run.dir={run_dir}", "train.max_steps=500", f"train.stop_at_step={step + 2}"]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    starts = read_records(run_dir, "start")
    assert starts[-1]["step"] == step


def test_a_nan_loss_stops_the_run_and_the_latest_checkpoint_is_the_last_finite_one(base, tmp_path):
    run_dir = tmp_path / "diverged"
    env = {**os.environ, "RAYLLM_FAULT_NAN_FROM": "5"}  # steps 5, 6, 7 are NaN; checkpoints every 2 steps
    proc = subprocess.run(
        torchrun_cmd(2, [*base, f"run.dir={run_dir}", "train.max_steps=12"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0
    assert "rayllm: error: the loss or gradient norm was NaN or infinite at 3 steps in a row, up to step 7" in (
        proc.stderr
    ), proc.stderr[-3000:]
    complete = sorted(p.name for p in run_dir.glob("checkpoint_*") if (p / COMMIT_FILE).exists())
    assert complete[-1] == "checkpoint_00000004"  # not 6: its step was skipped, not trained
    model = rayllm.load(str(run_dir), device="cpu").model
    assert all(torch.isfinite(p).all() for p in model.parameters())
    skipped = [r["step"] for r in read_records(run_dir, "nonfinite")]
    assert skipped == [5, 6, 7]
