"""Failures and resizes on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster, all on
127.0.0.1; see ray_cluster_scenarios.py): ten of them, one after another, in one chaos run
(each run pays Ray's startups again): workers killed and signalled, a data relay and the
stream server killed, a hung rank, a crash before a commit, nodes removed and added. It must
finish with the right step count, the global batch constant, every sequence once and the loss
of an uninterrupted run. First on the same cluster, a spot interruption notice to one node."""

from __future__ import annotations

import pytest
from helpers import TEST_MODEL, free_port, run_cluster_scenarios

pytestmark = pytest.mark.slow
# Enough steps for every event to land mid-run: each comes a few steps after the restart before
# it, but a killed relay or server is noticed only once the ranks have used the batches they
# hold (up to 32 steps), and the run waits before step 150 (PAUSE_AT) for the last one. A step
# takes about 0.1 s here: the runs' time is Ray's restarts.
STEPS, G, SEQ = 160, 8, 64
NOTICE_STEPS, NOTICE_AT = 10, 6  # ray_cluster_scenarios.py's: every rank holds before NOTICE_AT until the notice landed


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
        "train.keep_checkpoints=60",  # every committed checkpoint's ids: each sequence once
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
        "metadata_port": free_port(),  # the worker nodes' EC2 metadata service, for "notice"
        "scenarios": ["notice", "reference", "chaos", "init_from"],
    }
    found, output = run_cluster_scenarios(args, timeout_s=1500)
    print({name: round(run["seconds"]) for name, run in found.items()})  # where the time goes (pytest -s)
    return {**found, "output": output}


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


EVENTS = [
    "worker SIGKILL",
    "relay killed",
    "worker SIGTERM",
    "server killed",
    "hang",
    "crash before commit",
    "node removed",
    "node added",
    "worker SIGKILL",
    "both nodes replaced",
]


def test_ten_failures_in_one_run_each_cost_at_most_two_steps_and_change_nothing(scenarios):
    """The chaos run (ray_cluster_scenarios.py): every event lands, each starts one new attempt,
    which resumes from the in-memory checkpoint of one of the two steps before, but where a stored
    one is as new (the SIGTERM's) or no in-memory copy survives (both nodes replaced); the
    sequences, every one once, and the final loss are the uninterrupted run's."""
    ref, run = scenarios["reference"], scenarios["chaos"]
    check_completed(ref)
    check_completed(run)
    assert run["events"] == EVENTS, run["events"]
    starts = run["starts"]
    assert [s["world_size"] for s in starts] == [2] * 7 + [1, 2, 2, 2], starts
    sigterm = EVENTS.index("worker SIGTERM") + 1
    expected = [None] + ["memory"] * 9 + ["storage"]
    expected[sigterm] = "storage"  # it checkpointed (stored, synchronously) at the step it was signalled
    assert run["resumed_from"] == expected, run["resumed_from"]
    steps, before = [s["step"] for s in starts], run["trained_before"]
    for i, source in enumerate(run["resumed_from"][1:-1], start=1):
        # In memory every step, written in the background: the step before's save may still have
        # been written when the fault came (here a write takes longer than a step), so at most 2.
        assert 0 <= before[i] - steps[i] <= (2 if source == "memory" else 0), (i, steps, before)
    assert steps[-1] % 4 == 0 and steps[-1] < before[-1], (steps, before)  # a stored checkpoint's step
    assert [(r["from"], r["to"]) for r in run["resizes"]][:2] == [(2, 1), (1, 2)]
    assert abs(final_loss(run) - final_loss(ref)) / final_loss(ref) <= 1e-4
    check_exactly_once(ref, run)


def test_restarts_keep_the_data_stream_running_unless_its_server_or_layout_changed(scenarios):
    """The driver's stream server outlives attempts: a restart at the same world size resumes
    from the steps it kept; after its own death it starts empty, and a resize changes which
    objects hold a node's rows, so it restarts its sources there."""
    kept = scenarios["chaos"]["stream_kept"]
    assert kept[:10] == [False, True, True, True, False, True, True, False, False, True], kept


def test_the_chaos_runs_failures_are_named(scenarios):
    run = scenarios["chaos"]
    failures = "\n".join(run["failures"])
    assert "data relay of this node died" in failures or "batches were lost" in failures, failures
    assert "data stream server died" in failures or "batches were lost" in failures, failures
    assert len(run["preempted"]) == 1, run["preempted"]
    assert run["crashed"] and run["crashed"].startswith("crashed before the commit of step"), run["crashed"]
    # The hang: rank 1, asleep inside a step, named in the watchdog's summary and in the failure.
    assert len(run["hang_summaries"]) == 1, run["hang_summaries"]
    assert "rank 1 on node" in run["hang_summaries"][0] and "maybe_hang" in run["hang_summaries"][0]
    assert "hang: no step finished" in failures


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


def test_a_spot_notice_to_one_node_checkpoints_at_the_next_step_and_the_run_moves_off_it(scenarios):
    """A local HTTP server poses as each worker node's EC2 metadata service (IMDSv2) and serves
    "terminate in 2 minutes" to one node mid-run (ray_cluster_scenarios.py's "notice", first on
    the cluster). That node's watcher names the notice and drains the node; the run checkpoints
    at the next step, restarts on the other node and a replacement, and trains every sequence
    exactly once; the restart is a preemption, not a failure: it passes under
    cluster.max_failures=0 (Ray Train's preemption budget takes it)."""
    run, output = scenarios["notice"], scenarios["output"]
    assert run["drained"], "the noticed node was never drained"
    assert run["error"] is None, run["error"]
    assert run["served_at"] == NOTICE_AT - 1, run["served_at"]
    # One line from the noticed node's watcher, naming the node and the notice.
    noticed = [line for line in output.splitlines() if "interruption notice" in line]
    assert len(noticed) == 1, noticed
    assert f"/{run['noticed_node']}: interruption notice, AWS spot instance-action (terminate at" in noticed[0]
    # The rank on the noticed node asked to stop; everyone checkpointed at the next step.
    (preempted,) = run["preempted"]
    assert preempted["step"] == NOTICE_AT, preempted
    assert run["nodes"][0][preempted["rank"]].endswith(run["noticed_node"]), (run["nodes"], preempted)
    assert [s["step"] for s in run["starts"]] == [0, NOTICE_AT], run["starts"]
    assert run["resumed_from"] == [None, "storage"], run["resumed_from"]
    assert not any(node.endswith(run["noticed_node"]) for node in run["nodes"][1]), run["nodes"]
    assert run["step"] == NOTICE_STEPS
    assert run["ids"] == run["expected_ids"]  # every sequence of the uninterrupted order, once
    assert len(run["ids"]) == NOTICE_STEPS * G
