"""Autoscaling simulated on one machine: a head started with Ray's fake multi-node provider
(every node a local process on 127.0.0.1) and no worker nodes; a run with
``cluster.num_workers: [1, 2]`` makes the autoscaler add worker nodes, and training grows to
2 workers (each needs a node's ``trainer`` resource, so 2 workers need 2 new nodes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_MODEL, free_port, kill_ray_head, ray_head_command

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _fake_cluster_config(gcs: str) -> dict:
    """Ray's fake_multinode provider: a CPU-less head and up to 2 one-trainer worker nodes,
    which it starts as local processes joining ``gcs``."""
    empty = {
        key: []
        for key in (
            "initialization_commands",
            "setup_commands",
            "head_setup_commands",
            "worker_setup_commands",
            "head_start_ray_commands",
            "worker_start_ray_commands",
        )
    }
    return {
        "cluster_name": "rayllm-fake",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs,  # else the nodes it starts look for a head on port 6379
        },
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "trainer": {
                "resources": {"CPU": 2, "trainer": 1},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
        },
        "head_node_type": "ray.head.default",  # the name the fake provider gives its head
        **empty,
    }


@pytest.fixture
def autoscaling_head(tmp_path_factory):
    """The head, with its autoscaler, in a temp dir of its own; stopped by the pids under it
    (`ray stop` would end every Ray on the machine)."""
    temp_dir = tmp_path_factory.mktemp("as")  # short: Ray's socket paths under it must stay < 108 bytes
    gcs = f"127.0.0.1:{free_port()}"
    config = temp_dir / "cluster.json"
    config.write_text(json.dumps(_fake_cluster_config(gcs)))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))},
        "RAY_AUTH_MODE": "disabled",
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    cmd = ray_head_command(temp_dir, gcs, free_port(), f"--autoscaling-config={config}", "--num-cpus=0")
    started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield gcs, env
    finally:
        kill_ray_head(temp_dir, gcs)


def _alive_worker_nodes(gcs: str, env: dict) -> int:
    code = (
        f"import ray; ray.init(address={gcs!r}, logging_level='ERROR');"
        "print('ALIVE_TRAINER_NODES', sum(1 for n in ray.nodes() if n['Alive'] and n['Resources'].get('trainer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    # The driver's stdout also carries the autoscaler's event lines ("Resized to 0 CPUs."),
    # in any order; read only the line this probe marked.
    counts = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("ALIVE_TRAINER_NODES")]
    assert counts, out.stdout + out.stderr
    return int(counts[-1])


def test_the_autoscaler_adds_nodes_and_training_grows_to_two_workers(
    autoscaling_head, corpus, tokenizer_file, tmp_path
):
    gcs, env = autoscaling_head
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rayllm.cli",
        "train",
        "configs/tiny.yaml",
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        f"run.dir={run_dir}",
        "train.max_steps=60",
        "train.log_every=1",
        "train.checkpoint_every=5",
        "tracking.enabled=false",
        f"cluster.address={gcs}",
        "cluster.num_workers=[1, 2]",
        "cluster.worker_resources={trainer: 1}",
        "cluster.resize_interval_s=2",
        "cluster.health_check_interval_s=0.5",
        "-q",
    ]
    assert _alive_worker_nodes(gcs, env) == 0  # the cluster starts with no worker nodes
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sizes = [r["world_size"] for r in records if r["kind"] == "start"]
    assert sizes[-1] == 2, sizes  # training grew to (or started at) 2 workers as nodes came up
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["step"] == 60 and train[-1]["world_size"] == 2
    assert all(r["tokens"] == r["step"] * 8 * 64 for r in train)  # the global batch held throughout
    assert _alive_worker_nodes(gcs, env) == 2  # the autoscaler added two worker nodes
    print(f"autoscaled run: {time.time() - started:.0f} s, starts at world sizes {sizes}")
