"""Joining or starting Ray with real clusters (rayllm/ray_cluster.py, rayllm/runtime/room.py): a script that trains several
times in one process (1, 2, then 1 workers), and a `ray start --head` too small for the run, which
ends at the wait's deadline naming the fix (the decisions behind both, without Ray:
tests/unit/test_ray_runtime.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import REPO, TEST_MODEL, cli_train_cmd, ray_head

THREE_RUNS = """
import json, os, sys
import ray
import rayllm
from rayllm import RayllmError, TrainConfig, ray_cluster
from rayllm.runtime import room

ray_cluster.machine_cpus = lambda: 2  # CI's machine: the first local Ray gets just 2 CPUs
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
ray_cluster.connect_ray(config.cluster.address, room.run_cpus(config))
try:
    room.wait_for_room(config, print)
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
    # Ray's warnings a user cannot act on, which every run printed: actors Ray would rebuild from
    # constructor arguments in the object store (ray#53727: the stream server, the relays, Ray Train's
    # preemption watcher) and the raylet's count of worker processes on a 2-core machine.
    output = proc.stdout + proc.stderr
    assert "has constructor arguments in the object store" not in output, output[-5000:]
    assert "maximum expected startup concurrency" not in output, output[-5000:]
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
