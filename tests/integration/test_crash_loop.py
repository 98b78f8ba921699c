"""A process that dies hard at the same place on every attempt (os._exit before a commit: what a
segfault, an OOM kill or the hang watchdog's exit look like to Ray Train) never reaches the
failure record; with ``cluster.max_failures: -1`` the run must still end, naming the step."""

from __future__ import annotations

import re
import threading
import time

import pytest
from helpers import read_records

from rayllm import RayllmError, TrainConfig, train

pytestmark = pytest.mark.slow


def rearm(marker, fired: list, stop: threading.Event) -> threading.Thread:
    """Remove the crash hook's marker as soon as it appears: the hook fires again on the next attempt.
    Five times at most: without the rule under test the run would restart for ever; then it finishes."""

    def watch():
        while not stop.is_set() and len(fired) < 5:
            if marker.exists():
                marker.unlink()
                fired.append(time.time())
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_process_killed_at_the_same_step_on_every_attempt_ends_the_run_naming_it(
    ray_local, overrides, tmp_path, monkeypatch
):
    marker = tmp_path / "crashed"
    monkeypatch.setenv("RAYLLM_FAULT_CRASH_BEFORE_COMMIT", f"4:{marker}")
    config = TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[
            *overrides,
            "data.val=null",
            "train.max_steps=8",
            "train.checkpoint_every=2",
            "train.log_every=1",
            "train.sample_tokens=0",
            "tracking.enabled=false",
            "cluster.num_workers=1",
            "cluster.max_failures=-1",  # restarted for ever, were the attempts not counted
            "cluster.max_attempts_without_progress=2",
        ],
    )
    fired, stop = [], threading.Event()
    watcher = rearm(marker, fired, stop)
    try:
        with pytest.raises(RayllmError) as caught:
            train(config, quiet=True)
    finally:
        stop.set()
        watcher.join(timeout=5)
    message = str(caught.value)
    found = re.match(
        r"training failed: 2 attempts in a row ended without a new checkpoint, (?:each at step|at steps) ([\d, ]+)",
        message,
    )
    assert found, message
    steps = [int(step) for step in found.group(1).split(",")]
    # killed in the commit of step 4's checkpoint, which may finish while step 5 runs
    assert set(steps) <= {3, 4, 5}, message
    assert "the process was killed" in message and "cluster.max_attempts_without_progress" in message
    assert len(fired) == 3  # the first attempt committed step 2; the next two made no progress
    starts = [r["step"] for r in read_records(config.run.dir, "start")]
    assert starts == [0, 2, 2], starts
