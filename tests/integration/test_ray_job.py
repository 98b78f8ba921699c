"""Through a real `ray start --head` (127.0.0.1, token authentication) and real `ray job submit`:
`ray job stop` sends the job SIGTERM, rayllm saves a checkpoint at the next step, and
submitting the same job again resumes from that checkpoint; and after the head node is lost,
the same job on a new head resumes from the latest checkpoint and finishes as one Aim run.
Both in one training run (three submissions of one job), so the startups they share, a head's
and a job's, are paid once."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, TEST_MODEL, free_port, kill_ray_head, ray_head_command, read_records

pytestmark = pytest.mark.slow
STEPS = 60
CHECKPOINT_EVERY = 5
# The first job waits before this step until `ray job stop` has reached its driver: the stop's
# checkpoint then lands at this step, which is no periodic checkpoint's (not a multiple of 5).
STOP_AT = 8


class Head:
    """A head node started by the CLI, with its own temp dir (so `ray.init()` elsewhere in the
    session never finds it; short, as Ray's socket paths in it must stay under 108 bytes) and
    token authentication on. ``replace()`` kills every process of it (as when its machine goes
    away) and starts a new one, which the module's later tests then use."""

    def __init__(self, temp_dirs: pytest.TempPathFactory):
        self._temp_dirs = temp_dirs
        self._temp_dir: Path | None = None

    def start(self) -> None:
        dashboard = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self._temp_dir = self._temp_dirs.mktemp("head")
        self._gcs_address = f"127.0.0.1:{free_port()}"
        self.address = f"http://127.0.0.1:{dashboard}"
        cmd = ray_head_command(self._temp_dir, self._gcs_address, dashboard, "--num-cpus=4")
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def kill(self) -> None:
        if self._temp_dir is not None:
            kill_ray_head(self._temp_dir, self._gcs_address)
            self._temp_dir = None

    def replace(self) -> None:
        self.kill()
        self.start()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    head = Head(tmp_path_factory)
    try:
        head.start()
        yield head
    finally:
        head.kill()


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


def _registered_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints Ray Train has registered (so a failure now resumes from one)."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # none yet, or being written
        return []
    return [int(r["checkpoint_dir_name"].rsplit("_", 1)[1]) for r in snapshot.get("checkpoint_results") or []]


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


def _wait_until(condition, address: str, env: dict, job_id: str, timeout: float = 300) -> None:
    """Until ``condition()`` holds, the job has ended, or ``timeout``: the run dir is read every
    0.2 s, the job's status (a `ray job` process, a second of CPU) every 5 s."""
    deadline = time.time() + timeout
    status_at = time.time()
    while time.time() < deadline and not condition():
        time.sleep(0.2)
        if time.time() - status_at >= 5:
            status_at = time.time()
            status = _job(address, env, "status", job_id).stdout.lower()
            if any(end in status for end in ("failed", "succeeded", "stopped")):
                return


def _submit_until_step(address: str, env: dict, run_dir: Path, step: int, *args: str) -> str:
    """Submit without waiting; return the job id once the run has logged ``step`` (or ended)."""
    submitted = _submit(address, env, "--no-wait", *args, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = re.search(r"raysubmit_\w+", submitted.stdout + submitted.stderr).group(0)
    trained = lambda: any(r["step"] >= step for r in read_records(run_dir, "train"))  # noqa: E731
    _wait_until(trained, address, env, job_id)
    assert trained(), _job(address, env, "logs", job_id).stdout[-3000:]
    return job_id


def test_ray_job_stop_checkpoints_and_the_same_job_resumes_then_after_the_head_is_lost_it_resumes_on_a_new_head(
    ray_head, corpus, tokenizer_file, tmp_path
):
    """One run through three submissions of the same job. `ray job stop`: the job checkpoints at
    the next step and ends as stopped; submitted again, it resumes from that checkpoint. Then the
    head node dies mid-run (every process of it, the job's driver with them, as when its machine
    goes away); on a new head the same job resumes from the latest checkpoint in run.dir and
    finishes, and Aim shows one run whose steps continue (Ray issue #45516)."""
    import aim
    import psutil

    run_dir = tmp_path / "run"
    hold = tmp_path / "hold"  # while it exists, the job waits before step STOP_AT (the first job only)
    entry = [
        "env",
        f"RAYLLM_FAULT_PAUSE_AT={STOP_AT}:{hold}",
        *_pretrain(
            corpus,
            tokenizer_file,
            run_dir,
            f"data.val={corpus / 'val'}",
            f"train.max_steps={STEPS}",
            "train.val_every=20",
            f"train.checkpoint_every={CHECKPOINT_EVERY}",
            "cluster.health_check_interval_s=0.2",  # checkpoints come fast here: register each soon
        ),
    ]
    assert STOP_AT % CHECKPOINT_EVERY != 0
    # ray job stop gives a job 3 s before SIGKILL by default; jobs/runtime_env.yaml gives it more.
    common = ["--working-dir", str(REPO), "--runtime-env", str(REPO / "jobs" / "runtime_env.yaml")]

    # 1. `ray job stop`: SIGTERM to the driver, a checkpoint at the next step, the job stopped.
    hold.touch()
    job_id = _submit_until_step(ray_head.address, ray_head.env, run_dir, STOP_AT - 1, *common, "--", *entry)
    stopping = subprocess.Popen(
        ["ray", "job", "stop", "--address", ray_head.address, job_id],
        env=ray_head.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    logs = ""
    while "SIGTERM: saving a checkpoint at the next step" not in logs and time.time() < deadline:
        time.sleep(1)
        logs = _job(ray_head.address, ray_head.env, "logs", job_id).stdout
    hold.unlink()  # the driver has taken the stop: the job trains step STOP_AT, checkpoints and ends
    stopped_output = stopping.communicate(timeout=300)[0]
    assert stopping.returncode == 0, stopped_output
    status = _job(ray_head.address, ray_head.env, "status", job_id)
    assert "was stopped" in status.stdout + status.stderr
    assert "SIGTERM: saving a checkpoint at the next step" in logs, logs[-3000:]
    stop_step = next(r["step"] for r in read_records(run_dir, "stopped"))
    assert stop_step == STOP_AT  # the step after the signal, not a periodic checkpoint's
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint_0*"))
    assert checkpoints[-1] == f"checkpoint_{stop_step:08d}"  # the stop's checkpoint, not a periodic one

    # 2. The same job again, on the same head: it resumes where the first one stopped. The head
    # is lost once it has trained on and Ray Train has registered a checkpoint after the stop's.
    job_id = _submit_until_step(ray_head.address, ray_head.env, run_dir, stop_step + 1, *common, "--", *entry)
    starts = read_records(run_dir, "start")
    assert [s["step"] for s in starts] == [0, stop_step]  # the second job resumed where the first stopped
    newer = lambda: any(step > stop_step for step in _registered_steps(run_dir))  # noqa: E731
    _wait_until(newer, ray_head.address, ray_head.env, job_id, timeout=120)
    assert newer(), _job(ray_head.address, ray_head.env, "logs", job_id).stdout[-3000:]
    drivers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "jobs/pretrain.py" in " ".join(p.info["cmdline"] or []) and str(run_dir) in " ".join(p.info["cmdline"])
    ]
    assert drivers
    for p in drivers:
        p.kill()  # SIGKILL, like the rest of the head: no handler runs, no final checkpoint
    ray_head.replace()  # every process of the head killed; a new head, with its own token
    killed_at = max(r["step"] for r in read_records(run_dir, "train"))
    assert killed_at < STEPS

    # 3. The same job on the new head: it resumes from the latest checkpoint and finishes.
    again = _submit(ray_head.address, ray_head.env, *common, "--", *entry)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "succeeded" in again.stdout + again.stderr
    assert f"[rayllm] step {STEPS}/{STEPS} | loss" in again.stdout  # the job's logs show training
    starts = read_records(run_dir, "start")
    assert len(starts) == 3 and starts[1]["step"] == stop_step
    resumed = starts[2]["step"]  # a periodic checkpoint's, after the stop's: the latest one
    assert stop_step < resumed <= killed_at and resumed % CHECKPOINT_EVERY == 0, starts
    done = read_records(run_dir, "train")[-1]
    assert done["step"] == STEPS

    repo = aim.Repo(str(run_dir / "aim"))
    runs = list(repo.iter_runs())
    assert len(runs) == 1  # one Aim run for the whole training run, no duplicate after the stop or the loss
    metrics = {m.name: m.dataframe() for m in runs[0].metrics() if m.context.to_dict().get("subset") == "train"}
    assert list(metrics["loss"]["step"]) == list(range(1, STEPS + 1))  # steps continue, each once
    assert metrics["restarts"]["value"].iloc[-1] == 2  # resumed twice: after the stop and after the loss


@pytest.mark.parametrize("token", [None, "0" * 64], ids=["no token", "wrong token"])
def test_a_submission_without_the_clusters_token_fails_with_an_authentication_error(ray_head, tmp_path, token):
    env = {k: v for k, v in ray_head.env.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    proc = _job(ray_head.address, env, "submit", "--", "python", "-c", "print('never runs')", timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    expected = "Invalid authentication token" if token else "Missing authentication token"
    assert expected in output, output[-3000:]
    assert "never runs" not in output
