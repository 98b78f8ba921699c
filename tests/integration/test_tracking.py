"""Aim tracking against real servers on 127.0.0.1: a run tracked through `aim server` that goes
away mid-run and comes back (training must not notice beyond a warning, and what Aim buffered
meanwhile must arrive), a server that never comes back (the run must still end), and Aim's UI
(`aim up`) listing the run through its HTTP API."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, read_records

from rayllm import TrainConfig, train
from rayllm.runtime.tracking import Tracker

pytestmark = pytest.mark.slow
STEPS = 60


def _aim_cli(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "aim"), *args]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _aim_server(repo: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        _aim_cli("server", "--repo", str(repo), "--host", "127.0.0.1", "--port", str(port)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the server and its workers stop together
    )
    _wait_for_port(port, server)
    return server


def _stop(server: subprocess.Popen, port: int) -> None:
    """SIGKILL the server and its uvicorn worker (which would otherwise wait for open connections)."""
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)
    gone_by = time.time() + 30
    while _answers(port) and time.time() < gone_by:
        time.sleep(0.2)
    assert not _answers(port)


def _wait_for_step(run_dir: Path, step: int, thread: threading.Thread) -> int:
    deadline = time.time() + 300
    while (
        time.time() < deadline
        and thread.is_alive()
        and not any(r.get("step", 0) >= step for r in read_records(run_dir))
    ):
        time.sleep(0.2)
    return max((r.get("step", 0) for r in read_records(run_dir)), default=0)


@pytest.fixture(scope="module")
def remote_run(ray_local, corpus, tokenizer_file, tmp_path_factory):
    """A run tracked through a real `aim server`, which is killed after step 10 and started
    again (same repo, same port) 15 steps later."""
    from helpers import TEST_MODEL

    repo = tmp_path_factory.mktemp("aim-server-repo")
    subprocess.run(_aim_cli("init"), cwd=repo, check=True, capture_output=True)
    port = free_port()
    server = _aim_server(repo, port)
    run_dir = tmp_path_factory.mktemp("remote") / "run"
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[
            *TEST_MODEL,
            f"data.train={corpus / 'train'}",
            f"data.val={corpus / 'val'}",
            f"data.tokenizer={tokenizer_file}",
            "data.demo_corpus=false",
            f"run.dir={run_dir}",
            f"train.max_steps={STEPS}",
            "train.log_every=1",
            "train.val_every=20",
            "train.checkpoint_every=20",
            f"tracking.repo=aim://127.0.0.1:{port}",
        ],
    )
    box: dict = {}
    stderr = io.StringIO()
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(stderr):
            mp.setattr(Tracker, "SERVER_CHECK_S", 0.2)
            thread = threading.Thread(target=lambda: box.update(result=train(config, quiet=True)), daemon=True)
            thread.start()
            _wait_for_step(run_dir, 10, thread)
            _stop(server, port)
            stopped_at = _wait_for_step(run_dir, 0, thread)
            back_at = _wait_for_step(run_dir, stopped_at + 15, thread)
            server = _aim_server(repo, port)
            thread.join(timeout=600)
    finally:
        _stop(server, port)
    yield {"result": box.get("result"), "stderr": stderr.getvalue(), "repo": repo, "outage": (stopped_at, back_at)}


def test_remote_tracking_survives_the_server_going_away_and_loses_nothing(remote_run):
    result = remote_run["result"]
    stopped_at, back_at = remote_run["outage"]
    assert result is not None and result.step == STEPS  # training finished
    assert result.checkpoint.endswith(f"checkpoint_{STEPS:08d}")  # checkpoints unaffected
    assert stopped_at < back_at < STEPS  # the server was away while steps were trained
    assert "does not answer; training goes on" in remote_run["stderr"]
    assert "answers again" in remote_run["stderr"]

    import aim
    from aim.sdk.index_manager import RepoIndexManager

    # Index the run, as `aim up` on the server's repo does, to query it.
    RepoIndexManager.get_index_manager(aim.Repo.from_path(str(remote_run["repo"]))).index(result.aim_run_hash)
    run = aim.Repo(str(remote_run["repo"])).get_run(result.aim_run_hash)
    assert run is not None
    loss = next(m for m in run.metrics() if m.name == "loss" and m.context.to_dict() == {"subset": "train"})
    # Every step, the outage's too: Aim buffered them and sent them once the server was back.
    assert list(loss.dataframe()["step"]) == list(range(1, STEPS + 1))
    assert run["train"]["max_steps"] == STEPS


def test_a_tracking_server_that_never_comes_back_does_not_keep_the_run_from_ending(tmp_path):
    """The server dies for good: the tracker warns, waits tracking.flush_timeout_s for it, gives
    up what Aim buffered, and the process exits (Aim's own exit handler would wait for ever)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(_aim_cli("init"), cwd=repo, check=True, capture_output=True)
    port = free_port()
    server = _aim_server(repo, port)
    script = f"""
import sys, time
from rayllm.config import TrainConfig
from rayllm.runtime.tracking import Tracker
config = TrainConfig.from_dict({{}}, ["tracking.repo=aim://127.0.0.1:{port}", "run.dir={tmp_path / "run"}",
                                      "tracking.flush_timeout_s=3"])
tracker = Tracker(config)
for step in range(1, 11):
    tracker.log_metrics({{"loss": 1.0 / step}}, step, "train")
print("logged", flush=True)
sys.stdin.readline()  # the test stops the server meanwhile
for step in range(11, 21):
    tracker.log_metrics({{"loss": 1.0 / step}}, step, "train")
tracker.close()
print("closed", flush=True)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "logged"
        time.sleep(1)  # let Aim send the first ten
        _stop(server, port)
        started = time.time()
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "closed" in out
    assert time.time() - started < 60  # 3 s of waiting for the server, then the process ends
    assert "waiting up to 3 s" in err and "gave up" in err and "metrics.jsonl" in err

    import aim
    from aim.sdk.index_manager import RepoIndexManager

    (run_hash,) = aim.Repo.from_path(str(repo)).list_all_runs()
    RepoIndexManager.get_index_manager(aim.Repo.from_path(str(repo))).index(run_hash)
    run = aim.Repo(str(repo)).get_run(run_hash)
    assert list(next(iter(run.metrics())).dataframe()["step"]) == list(range(1, 11))


def test_aim_ui_lists_the_run_through_its_http_api(remote_run):
    result = remote_run["result"]
    port = free_port()
    ui = subprocess.Popen(
        _aim_cli("up", "--repo", str(remote_run["repo"]), "--host", "127.0.0.1", "--port", str(port)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # `aim up` runs its server in a child: stop the whole group
    )
    try:
        _wait_for_port(port, ui, timeout=120)

        def get(path: str):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api{path}", timeout=30) as r:
                return json.loads(r.read())

        experiments = get("/experiments/")
        tiny = next(e for e in experiments if e["name"] == "tiny")
        runs = get(f"/experiments/{tiny['id']}/runs/")["runs"]
        assert result.aim_run_hash in [r["run_id"] for r in runs]
        info = get(f"/runs/{result.aim_run_hash}/info/")
        assert info["params"]["train"]["max_steps"] == STEPS  # the resolved config
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
