"""Joining or starting Ray, and waiting for room with a deadline (rayllm/ray_runtime.py): a script
that trains several times in one process, a cluster too small for the run, and the decisions
behind both, tested without Ray where they can be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import REPO, TEST_MODEL, cli_train_cmd, ray_head

from rayllm import RayllmError, TrainConfig
from rayllm import ray_runtime as rt


def _config(*overrides: str) -> TrainConfig:
    return TrainConfig.from_dict({}, overrides=list(overrides))


# --- the decisions, without Ray ---------------------------------------------------------------


def test_workers_that_do_not_fit_name_the_resource_short_and_its_fix():
    two = _config("cluster.num_workers=2")
    assert rt.worker_shortage([{"CPU": 2}], two) is None
    cpus = rt.worker_shortage([{"CPU": 1}], two)
    assert "1 of the 2 CPU needed" in cpus and "ray start --num-cpus=3" in cpus and "cluster.cpus_per_worker" in cpus
    gpus = rt.worker_shortage([{"CPU": 8, "GPU": 1}], _config("cluster.num_workers=2", "cluster.use_gpu=true"))
    assert "1 of the 2 GPU needed" in gpus and "cluster.use_gpu=false" in gpus
    custom = rt.worker_shortage([{"CPU": 8, "trainer": 1}], _config("cluster.worker_resources={trainer: 1}"))
    assert '"trainer": 2' in custom and "cluster.worker_resources" in custom
    # Enough CPUs in all, but no node holds a whole 2-CPU worker: Ray Train places a worker on one node.
    packed = rt.worker_shortage([{"CPU": 1}, {"CPU": 1}], _config("cluster.num_workers=1", "cluster.cpus_per_worker=2"))
    assert "no more nodes have room for a whole worker" in packed
    assert rt.worker_shortage([{"CPU": 1}], _config("cluster.num_workers=[1, 2]")) is None  # elastic: the fewest
    assert "\n" not in cpus + gpus + custom + packed  # one line each


def test_room_needs_the_workers_and_a_cpu_for_the_data_tasks():
    two = _config("cluster.num_workers=2")
    assert rt.room_problem([{"CPU": 3}], two) is None
    assert "ray start --num-cpus=3" in rt.room_problem([{"CPU": 2}], two)  # workers fit, data tasks do not
    assert "do not fit" in rt.room_problem([{"CPU": 0}], two)  # a CPU-less head: workers first


def test_an_autoscaler_is_told_apart_from_the_readonly_monitor_every_head_runs():
    # As Ray 2.60's monitor wrote them (GCS KV "__autoscaling_status"): a plain `ray start --head`,
    # and a head started with --autoscaling-config (fake_multinode provider).
    plain = {"autoscaler_report": {"node_type_mapping": {"4696d7": "node_4696d7"}, "pending_launches": {}}}
    scaling = {"autoscaler_report": {"node_type_mapping": {"ffff00": "ray.head.default"}, "pending_launches": {}}}
    launching = {"autoscaler_report": {"node_type_mapping": {}, "pending_launches": {"trainer": 1}}}
    assert not rt.configured_node_types(plain)
    assert rt.configured_node_types(scaling)
    assert rt.configured_node_types(launching)
    assert not rt.configured_node_types(None)  # no monitor has written yet


def test_only_the_ray_rayllm_started_or_joined_is_replaced(monkeypatch):
    monkeypatch.setattr(rt, "_session", lambda: "session_now")
    monkeypatch.setattr(rt, "_connected", {"session": "session_now", "address": None, "cpus": 2})
    assert rt._replace_ours(None, 3)  # a local Ray too small for 2 workers: restarted bigger
    assert not rt._replace_ours(None, 2)  # big enough: kept (3 runs in one process reuse it)
    assert rt._replace_ours("127.0.0.1:6380", 2)  # a run that names a cluster goes there
    monkeypatch.setattr(rt, "_connected", {"session": "session_now", "address": "127.0.0.1:6380", "cpus": None})
    assert not rt._replace_ours("127.0.0.1:6380", 9)
    assert rt._replace_ours(None, 2)
    monkeypatch.setattr(rt, "_connected", {"session": "an_older_one", "address": None, "cpus": 2})
    assert not rt._replace_ours(None, 9)  # the user shut ours down and started their own: theirs stays
    monkeypatch.setattr(rt, "_connected", None)
    assert not rt._replace_ours("127.0.0.1:6380", 9)  # the user's ray.init before any run


def _fake_cluster(monkeypatch, nodes_over_time, *, autoscaler=False, local=False):
    """wait_for_room against scripted cluster states; returns the placement-group requests it made."""
    states = iter(nodes_over_time)
    last = [None]

    def nodes():
        last[0] = next(states, last[0])
        return last[0]

    requested, dropped = [], []
    monkeypatch.setattr(rt, "_alive_nodes", nodes)
    monkeypatch.setattr(rt, "autoscaler_running", lambda: autoscaler)
    monkeypatch.setattr(rt, "started_local_ray", lambda: local)
    monkeypatch.setattr(rt, "_request_nodes", lambda config: requested.append(config) or "group")
    monkeypatch.setattr(rt, "_drop", lambda group: dropped.append(group))
    return requested, dropped


def test_a_cluster_that_cannot_grow_ends_the_wait_at_the_deadline_naming_the_fix(monkeypatch):
    _fake_cluster(monkeypatch, [[{"CPU": 2}]])
    lines = []
    started = time.monotonic()
    with pytest.raises(RayllmError) as e:
        config = _config("cluster.num_workers=2", "cluster.resource_wait_s=0.5")
        rt.wait_for_room(config, lines.append, poll_s=0.05, progress_every_s=0.2)
    assert 0.5 <= time.monotonic() - started < 3
    assert "without an autoscaler" in str(e.value) and "ray start --num-cpus=3" in str(e.value)
    assert "\n" not in str(e.value)
    assert 2 <= len(lines) <= 4 and all("of cluster.resource_wait_s=0.5s" in line for line in lines)


def test_room_that_comes_before_the_deadline_ends_the_wait(monkeypatch):
    _fake_cluster(monkeypatch, [[{"CPU": 2}], [{"CPU": 2}], [{"CPU": 2}, {"CPU": 2}]])
    lines = []
    rt.wait_for_room(_config("cluster.num_workers=2"), lines.append, poll_s=0.01)
    assert len(lines) == 1 and lines[0].startswith("waiting for room: ")


def test_a_local_ray_rayllm_started_cannot_grow_so_it_fails_at_once(monkeypatch):
    _fake_cluster(monkeypatch, [[{"CPU": 8}]], local=True)
    with pytest.raises(RayllmError, match="the local Ray rayllm started: .*cluster.use_gpu=false"):
        rt.wait_for_room(_config("cluster.use_gpu=true", "cluster.resource_wait_s=600"), print)


def test_with_an_autoscaler_it_asks_for_nodes_and_waits_past_the_deadline(monkeypatch):
    head, grown = [{"CPU": 0}], [{"CPU": 0}, {"CPU": 2, "trainer": 1}]
    requested, dropped = _fake_cluster(monkeypatch, [head] * 30 + [grown], autoscaler=True)
    lines = []
    config = _config(
        "cluster.num_workers=[1, 2]", "cluster.worker_resources={trainer: 1}", "cluster.resource_wait_s=0.01"
    )
    rt.wait_for_room(config, lines.append, poll_s=0.01, progress_every_s=0.1)
    assert len(requested) == 1 and dropped == ["group"]  # one request, withdrawn once nodes came
    assert lines and all("autoscaler is adding nodes" in line for line in lines)
    # Only the data tasks lack room (2 workers would take both CPUs): their own demand grows the cluster.
    requested, _ = _fake_cluster(monkeypatch, [[{"CPU": 2}]], autoscaler=True)
    rt.wait_for_room(_config("cluster.num_workers=2"), lines.append)
    assert requested == []


# --- with Ray ---------------------------------------------------------------------------------

THREE_RUNS = """
import json, os, sys
import ray
import rayllm
from rayllm import RayllmError, TrainConfig, ray_runtime

ray_runtime.machine_cpus = lambda: 2  # CI's machine: the first local Ray gets just 2 CPUs
args = json.loads(sys.argv[1])
for i, workers in enumerate([1, 2, 1]):
    overrides = [*args["overrides"], f"cluster.num_workers={workers}", f"run.dir={args['root']}/run{i}"]
    result = rayllm.train(TrainConfig.from_yaml("configs/tiny.yaml", overrides=overrides), quiet=True)
    cpus = ray.cluster_resources()["CPU"]
    print("RUN", json.dumps({"workers": workers, "step": result.step, "cpus": cpus, "s": round(result.seconds)}), flush=True)

# The user's own Ray is never replaced: a too-small one ends the run at the deadline instead.
ray.shutdown()
ray.init(num_cpus=1, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="WARNING")
session = ray.get_runtime_context().get_session_name()
config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*args["overrides"], "cluster.resource_wait_s=1"])
ray_runtime.connect_ray(config)
try:
    ray_runtime.wait_for_room(config, print)
    error = None
except RayllmError as e:
    error = str(e)
same = ray.get_runtime_context().get_session_name() == session
print("USER", json.dumps({"same": same, "error": error}), flush=True)
"""


@pytest.mark.slow
def test_one_process_trains_with_1_then_2_then_1_workers(corpus, tokenizer_file, tmp_path):
    overrides = [
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        "train.max_steps=3",
        "tracking.enabled=false",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(THREE_RUNS),
            json.dumps({"overrides": overrides, "root": str(tmp_path)}),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    runs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("RUN ")]
    assert [(r["workers"], r["step"]) for r in runs] == [(1, 3), (2, 3), (1, 3)]
    # 2 logical CPUs for 1 worker; restarted with 3 for 2 workers (room for the data tasks); kept for 1.
    assert [r["cpus"] for r in runs] == [2, 3, 3]
    user = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("USER ")][-1]
    assert user["same"] and "without an autoscaler" in user["error"] and "--num-cpus=3" in user["error"]
    print(f"three runs in one process: {time.time() - started:.0f} s, each {[r['s'] for r in runs]} s")


@pytest.fixture
def two_cpu_head(tmp_path_factory):
    """`ray start --head --num-cpus=2` on 127.0.0.1 (no autoscaling config), ports of its own."""
    temp_dir = tmp_path_factory.mktemp("rh")  # short: Ray's socket paths under it must stay < 108 bytes
    with ray_head(temp_dir, "--num-cpus=2") as (gcs, env):
        yield gcs, env


def test_a_cluster_whose_workers_take_every_cpu_ends_the_run_naming_the_fix(
    two_cpu_head, corpus, tokenizer_file, tmp_path
):
    gcs, env = two_cpu_head
    cmd = cli_train_cmd(
        corpus,
        tokenizer_file,
        tmp_path / "run",
        "tracking.enabled=false",
        f"cluster.address={gcs}",
        "cluster.num_workers=2",
        "cluster.cpus_per_worker=1",
        "cluster.resource_wait_s=5",
    )
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.time() - started
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-5000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rayllm: error:")]
    assert len(errors) == 1 and "--num-cpus=3" in errors[0] and "cluster.cpus_per_worker" in errors[0], proc.stderr
    assert "cluster.resource_wait_s=5" in errors[0]
    assert "[rayllm] waiting for room: " in proc.stdout and "of cluster.resource_wait_s=5s" in proc.stdout
    assert seconds < 45, seconds  # data planning, joining, 5 s of waiting: not for ever
    print(f"too-small cluster: ended in {seconds:.0f} s with {errors[0]!r}")
