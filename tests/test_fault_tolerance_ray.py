"""Failures and resizes on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster, all on
127.0.0.1; see ray_cluster_scenarios.py): a worker process signalled, a rank dying between
checkpoint write and commit, and a worker process killed (three faults, one after another, in
one run: each run pays Ray's startups again), a node removed and added back. Each run must
finish with the right step count, the global batch constant, and the loss of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import TEST_MODEL, free_port

pytestmark = pytest.mark.slow
# Enough steps for every fault to land mid-run with room to spare: the faults run's SIGKILL comes
# once it has trained past step 30, and the elastic run waits before step 40 (PAUSE_AT) until it
# has grown back to 2 workers. A step takes about 0.1 s here: the runs' time is Ray's startups.
STEPS, G, SEQ = 60, 8, 64
CRASH_AT = 24  # the faults run's checkpoint whose commit the crash prevents (after the SIGTERM's)


@pytest.fixture(scope="module")
def scenarios(corpus, tokenizer_file, tmp_path_factory):
    overrides = [
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=20",  # every committed checkpoint's ids: each sequence once
        "data.record_ids=true",
        "tracking.enabled=false",
        "cluster.num_workers=2",
        "cluster.max_failures=3",
        "cluster.worker_resources={trainer: 1}",
    ]
    root = tmp_path_factory.mktemp("scenarios")
    args = {
        "overrides": overrides,
        "root": str(root),
        "dashboard_port": free_port(),
        "scenarios": ["reference", "faults", "elastic", "init_from"],
        "crash_at": CRASH_AT,
    }
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "tests/ray_cluster_scenarios.py", json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the script shuts its cluster down, whose processes would otherwise
        # outlive it and be found by the next ray.init on this machine.
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail("the cluster scenarios ran past 1,200 s:\n" + stdout[-3000:] + stderr[-5000:])
    lines = [line for line in stdout.splitlines() if line.startswith("SCENARIOS ")]
    assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-5000:]
    found = json.loads(lines[-1].removeprefix("SCENARIOS "))
    print({name: round(run["seconds"]) for name, run in found.items()})  # where the time goes (pytest -s)
    return found


def final_loss(run: dict) -> float:
    return [r for r in run["train"] if r["step"] == STEPS][-1]["loss"]


def check_completed(run: dict) -> None:
    assert run["error"] is None, run["error"]
    assert run["step"] == STEPS
    assert run["tokens"] == STEPS * G * SEQ
    for r in run["train"]:  # the global batch is G sequences at every step, on any world size
        assert r["tokens"] == r["step"] * G * SEQ, r


def check_exactly_once(ref: dict, run: dict) -> None:
    assert len(ref["ids"]) == STEPS * G == len({tuple(i) for i in ref["ids"]})
    assert run["ids"] == ref["ids"]  # the committed checkpoints record every sequence once


def test_sigterm_to_one_worker_checkpoints_at_the_next_step_and_the_run_goes_on(scenarios):
    run = scenarios["faults"]
    check_completed(run)
    assert run["signalled"]
    assert len(run["preempted"]) == 1, run["preempted"]
    step = run["preempted"][0]["step"]
    assert run["starts"][1]["step"] == step  # resumed at the very step it checkpointed: nothing lost
    before = [r["step"] for r in run["train"] if r["step"] <= step]
    assert sorted(before) == list(range(1, step + 1))  # ... and nothing trained twice around it


def test_killed_worker_the_run_restarts_and_matches_an_uninterrupted_run(scenarios):
    ref, run = scenarios["reference"], scenarios["faults"]
    check_completed(ref)
    check_completed(run)
    assert run["killed"]
    # Started, then restarted after the SIGTERM, the crash and the SIGKILL: the last from a checkpoint.
    assert len(run["starts"]) == 4 and run["starts"][3]["step"] > run["starts"][2]["step"]
    assert abs(final_loss(run) - final_loss(ref)) / final_loss(ref) <= 1e-4
    check_exactly_once(ref, run)


def test_crash_between_checkpoint_write_and_commit_resumes_from_the_previous_one(scenarios):
    ref, run = scenarios["reference"], scenarios["faults"]
    check_completed(run)
    assert run["crashed"] == f"crashed before the commit of step {CRASH_AT}", run["crashed"]
    preempted = run["preempted"][0]["step"]
    # After the SIGTERM's restart at its checkpoint, checkpoint CRASH_AT was written but never
    # committed: the run resumed from the one before it.
    assert [s["step"] for s in run["starts"]][:3] == [0, preempted, CRASH_AT - 4]
    assert abs(final_loss(run) - final_loss(ref)) / final_loss(ref) <= 1e-4


def test_node_removed_and_added_back_resizes_2_1_2_from_memory_then_falls_back_to_storage(scenarios):
    """A node lost: its ranks' in-memory shards are also on the other node, so the 1-worker group
    resumes from memory (resharded); grown back, from memory again; both nodes lost at once: from
    the stored checkpoint. Same trajectory and sequences as the uninterrupted run."""
    ref, run = scenarios["reference"], scenarios["elastic"]
    check_completed(run)
    assert run["events"] == ["removed", "added", "both replaced"], run["events"]
    assert [s["world_size"] for s in run["starts"]] == [2, 1, 2, 2], run["starts"]
    assert run["resumed_from"] == [None, "memory", "memory", "storage"], run["resumed_from"]
    steps, before = [s["step"] for s in run["starts"]], run["trained_before"]
    # From memory: at most the step whose save the loss cut short is trained again.
    assert 0 <= before[1] - steps[1] <= 1 and 0 <= before[2] - steps[2] <= 1, (steps, before)
    assert steps[3] % 4 == 0 and steps[3] < before[3], (steps, before)  # a stored checkpoint's step
    assert [(r["from"], r["to"]) for r in run["resizes"]][:2] == [(2, 1), (1, 2)]
    assert {r["world_size"] for r in run["train"]} == {1, 2}
    # 1 and 2 workers compute the same global batch; only float summation order differs.
    assert abs(final_loss(run) - final_loss(ref)) / final_loss(ref) <= 1e-3
    check_exactly_once(ref, run)


def test_init_from_a_folder_only_the_driver_reads_gives_its_loss_at_the_first_step(scenarios):
    """model.init_from on 2 worker nodes: the workers never touch the folder (moved away once the
    driver has converted it), and the first step's loss is the folder model's on that batch."""
    run = scenarios["init_from"]
    assert run["moved"] and run["error"] is None, run["error"]
    first = run["train"][0]
    assert first["step"] == 1 and run["starts"][0]["world_size"] == 2
    assert abs(first["loss"] - run["expected_first_loss"]) / run["expected_first_loss"] <= 1e-4
    scratch = scenarios["reference"]["train"][0]["loss"]
    assert abs(first["loss"] - scratch) / scratch > 1e-2  # a seed-0 start would not pass
