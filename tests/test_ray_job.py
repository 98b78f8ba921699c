"""Through a real `ray start --head` (127.0.0.1, token authentication) and real `ray job submit`:
`ray job stop` sends the job SIGTERM, rayllm saves a checkpoint at the next step, and
submitting the same job again resumes from that checkpoint and finishes the run; and after the
head node is lost, the same job on a new head resumes from the latest checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_MODEL, checkpoint_registered, free_port, kill_ray_head, ray_head_command

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS = 200


@contextlib.contextmanager
def _head(temp_dir: Path):
    """A head node started by the CLI, with its own temp dir (so `ray.init()` elsewhere in the
    session never finds it; short, as Ray's socket paths in it must stay under 108 bytes) and
    token authentication on; yields (dashboard address, env)."""
    dashboard = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    gcs_address = f"127.0.0.1:{free_port()}"
    cmd = ray_head_command(temp_dir, gcs_address, dashboard, "--num-cpus=4")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        kill_ray_head(temp_dir, gcs_address)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    with _head(tmp_path_factory.mktemp("ray-head")) as head:
        yield head


def _job(address: str, env: dict, command: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ray", "job", command, "--address", address, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _submit(address: str, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ray job submit`, retried while the head's job agent is still starting."""
    deadline = time.time() + 90
    while True:
        proc = _job(address, env, "submit", *args, timeout=timeout)
        if "No available agent" not in proc.stdout + proc.stderr or time.time() > deadline:
            return proc
        time.sleep(2)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pretrain(corpus: Path, tokenizer_file: Path, run_dir: Path, *overrides: str) -> list[str]:
    """The job's entrypoint: jobs/pretrain.py on the test corpus and model, 2 workers."""
    return [
        sys.executable,
        "jobs/pretrain.py",
        "configs/tiny.yaml",
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        "train.log_every=1",
        "cluster.num_workers=2",
        f"run.dir={run_dir}",
        *overrides,
    ]


def _submit_until_step(address: str, env: dict, run_dir: Path, step: int, *args: str) -> str:
    """Submit without waiting; return the job id once the run has logged ``step`` (or ended)."""
    submitted = _submit(address, env, "--no-wait", *args, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = re.search(r"raysubmit_\w+", submitted.stdout + submitted.stderr).group(0)
    deadline = time.time() + 300
    while time.time() < deadline and not any(r["kind"] == "train" and r["step"] >= step for r in _records(run_dir)):
        time.sleep(1)
        status = _job(address, env, "status", job_id).stdout.lower()
        if any(end in status for end in ("failed", "succeeded", "stopped")):
            break
    assert any(r["kind"] == "train" for r in _records(run_dir)), _job(address, env, "logs", job_id).stdout[-3000:]
    return job_id


def test_ray_job_stop_checkpoints_and_the_same_job_resumes(ray_head, corpus, tokenizer_file, tmp_path):
    address, env = ray_head
    run_dir = tmp_path / "run"
    entry = _pretrain(
        corpus,
        tokenizer_file,
        run_dir,
        "data.val=null",
        f"train.max_steps={STEPS}",
        "train.checkpoint_every=1000",
        "tracking.enabled=false",
    )
    # ray job stop gives a job 3 s before SIGKILL by default; jobs/runtime_env.yaml gives it more.
    common = ["--working-dir", str(REPO), "--runtime-env", str(REPO / "jobs" / "runtime_env.yaml")]
    job_id = _submit_until_step(address, env, run_dir, 5, *common, "--", *entry)

    stopped = _job(address, env, "stop", job_id, timeout=300)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    status = _job(address, env, "status", job_id)
    assert "was stopped" in status.stdout + status.stderr
    logs = _job(address, env, "logs", job_id).stdout
    assert "SIGTERM: saving a checkpoint at the next step" in logs, logs[-3000:]
    records = _records(run_dir)
    stop_step = next(r["step"] for r in records if r["kind"] == "stopped")
    assert 5 <= stop_step < STEPS
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint_0*"))
    assert checkpoints[-1] == f"checkpoint_{stop_step:08d}"  # the stop's checkpoint, not a periodic one

    again = _submit(address, env, *common, "--", *entry)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "succeeded" in again.stdout + again.stderr
    assert f"[rayllm] step {STEPS}/{STEPS} | loss" in again.stdout  # the job's logs show training
    starts = [r for r in _records(run_dir) if r["kind"] == "start"]
    assert [s["step"] for s in starts] == [0, stop_step]  # the second job resumed where the first stopped
    done = [r for r in _records(run_dir) if r["kind"] == "train"][-1]
    assert done["step"] == STEPS


@pytest.mark.parametrize("token", [None, "0" * 64], ids=["no token", "wrong token"])
def test_a_submission_without_the_clusters_token_fails_with_an_authentication_error(ray_head, tmp_path, token):
    address, env = ray_head
    env = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    proc = _job(address, env, "submit", "--", "python", "-c", "print('never runs')", timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    expected = "Invalid authentication token" if token else "Missing authentication token"
    assert expected in output, output[-3000:]
    assert "never runs" not in output


def test_after_the_head_node_is_lost_the_same_job_on_a_new_head_resumes_as_the_same_aim_run(
    corpus, tokenizer_file, tmp_path, tmp_path_factory
):
    """The head node dies mid-run (every process of it, the job's driver with them, as when its
    machine goes away); on a new head the same job submitted again resumes from the latest
    checkpoint in run.dir, and Aim shows one run whose steps continue (Ray issue #45516)."""
    import aim
    import psutil

    run_dir = tmp_path / "run"
    steps = 60
    entry = _pretrain(
        corpus,
        tokenizer_file,
        run_dir,
        f"data.val={corpus / 'val'}",
        f"train.max_steps={steps}",
        "train.val_every=20",
        "train.checkpoint_every=5",
        "cluster.health_check_interval_s=0.2",  # checkpoints come fast here: register each soon
    )
    common = ["--working-dir", str(REPO)]
    with _head(tmp_path_factory.mktemp("head")) as (address, env):
        _submit_until_step(address, env, run_dir, 12, *common, "--", *entry)
        deadline = time.time() + 60
        while not checkpoint_registered(run_dir) and time.time() < deadline:
            time.sleep(0.1)
        drivers = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "jobs/pretrain.py" in " ".join(p.info["cmdline"] or []) and str(run_dir) in " ".join(p.info["cmdline"])
        ]
        assert drivers
        for p in drivers:
            p.kill()  # SIGKILL, like the rest of the head: no handler runs, no final checkpoint
    killed_at = max(r["step"] for r in _records(run_dir) if r["kind"] == "train")
    assert killed_at < steps

    with _head(tmp_path_factory.mktemp("head")) as (address, env):
        again = _submit(address, env, *common, "--", *entry)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    starts = [r for r in _records(run_dir) if r["kind"] == "start"]
    assert len(starts) == 2 and 5 <= starts[1]["step"] <= killed_at and starts[1]["step"] % 5 == 0

    repo = aim.Repo(str(run_dir / "aim"))
    runs = list(repo.iter_runs())
    assert len(runs) == 1  # one Aim run for the whole training run, no duplicate after the loss
    metrics = {m.name: m.dataframe() for m in runs[0].metrics() if m.context.to_dict().get("subset") == "train"}
    assert list(metrics["loss"]["step"]) == list(range(1, steps + 1))  # steps continue, each once
    assert metrics["restarts"]["value"].iloc[-1] == 1
