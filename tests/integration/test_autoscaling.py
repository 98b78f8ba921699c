"""Autoscaling simulated on one machine: a head started with Ray's fake multi-node provider
(every node a local process on 127.0.0.1) and no worker nodes; a run with
``cluster.num_workers: [1, 2]`` makes the autoscaler add worker nodes, and training grows to
2 workers (each needs a node's ``trainer`` resource, so 2 workers need 2 new nodes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from helpers import REPO, cli_train_cmd, free_port, ray_head, read_records

pytestmark = pytest.mark.slow


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
    gcs_port = free_port()
    config = temp_dir / "cluster.json"
    config.write_text(json.dumps(_fake_cluster_config(f"127.0.0.1:{gcs_port}")))
    fake = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    with ray_head(temp_dir, f"--autoscaling-config={config}", "--num-cpus=0", env=fake, port=gcs_port) as head:
        yield head


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
    cmd = cli_train_cmd(
        corpus,
        tokenizer_file,
        run_dir,
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
    )
    assert _alive_worker_nodes(gcs, env) == 0  # the cluster starts with no worker nodes
    started = time.time()
    # The run waits before step 50 until it has grown to 2 workers, so a fast machine cannot end
    # it before the second node is up (CI saw it end at 1 worker).
    hold = tmp_path / "hold"
    hold.touch()
    env = {**env, "RAYLLM_FAULT_PAUSE_AT": f"50:{hold}"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if any(r["world_size"] == 2 for r in read_records(run_dir, "start")):
            break
        time.sleep(0.5)
    hold.unlink()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    records = read_records(run_dir)
    sizes = [r["world_size"] for r in records if r["kind"] == "start"]
    assert sizes[-1] == 2, sizes  # training grew to (or started at) 2 workers as nodes came up
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["step"] == 60 and train[-1]["world_size"] == 2
    assert all(r["tokens"] == r["step"] * 8 * 64 for r in train)  # the global batch held throughout
    assert _alive_worker_nodes(gcs, env) == 2  # the autoscaler added two worker nodes
    print(f"autoscaled run: {time.time() - started:.0f} s, starts at world sizes {sizes}")
