"""A spot interruption notice on a simulated cluster (ray.cluster_utils.Cluster: a head and two
one-CPU worker nodes on 127.0.0.1; ray_cluster_scenarios.py's "notice"): a local HTTP server
poses as each worker node's EC2 metadata service (IMDSv2) and serves "terminate in 2 minutes"
to one node mid-run. That node's watcher names the notice and drains the node; the run
checkpoints at the next step, restarts on the other node and a replacement, and trains every
sequence exactly once; the restart is a preemption, not a failure: it passes under
cluster.max_failures=0 (Ray Train's preemption budget takes it)."""

from __future__ import annotations

import pytest
from helpers import TEST_MODEL, free_port, run_cluster_scenarios

pytestmark = pytest.mark.slow
STEPS, G = 10, 8
NOTICE_AT = 6  # ray_cluster_scenarios.NOTICE_AT: every rank holds before it until the notice landed


def test_a_spot_notice_to_one_node_checkpoints_at_the_next_step_and_the_run_moves_off_it(
    corpus, tokenizer_file, tmp_path
):
    overrides = [
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        f"train.global_batch_size={G}",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.checkpoint_every=100",  # the only checkpoints: the notice's and the last
        "train.keep_checkpoints=10",
        "data.record_ids=true",
        "tracking.enabled=false",
        "cluster.num_workers=2",
        "cluster.max_failures=0",  # the notice's restart is a preemption: charged to no failure budget
        "cluster.worker_resources={trainer: 1}",
    ]
    args = {
        "overrides": overrides,
        "root": str(tmp_path),
        "dashboard_port": free_port(),
        "metadata_port": free_port(),
        "scenarios": ["notice"],
    }
    found, output = run_cluster_scenarios(args, timeout_s=600)
    run = found["notice"]
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
    assert run["step"] == STEPS
    assert run["ids"] == run["expected_ids"]  # every sequence of the uninterrupted order, once
    assert len(run["ids"]) == STEPS * G
