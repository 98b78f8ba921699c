"""cluster/ and configs/: every launcher YAML passes Ray's own cluster-config validation, the
KubeRay manifests carry what the RayCluster and RayJob CRDs require, the presets have the
published architectures' parameter counts, and the spot-first node-type scorer makes Ray's
own autoscaler scheduler launch spot, then on-demand once spot launches fail."""

from __future__ import annotations

import copy
import functools
import re
import shlex
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml
from helpers import REPO

from rayllm import TrainConfig
from rayllm.autoscaler import spot_first
from rayllm.loop.setup import model_args
from rayllm.model import Llama, num_params
from rayllm.parallel.layout import resolve_layout, usable_world_sizes

LAUNCHER_CONFIGS = sorted((REPO / "cluster").glob("*.yaml"))
KUBERAY = REPO / "cluster" / "kuberay"


def _load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_config_passes_rays_cluster_config_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = _load(path)
    validate_config(prepare_config(copy.deepcopy(raw)))  # what `ray up` runs before launching

    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0  # a CPU head
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types and all(t["max_workers"] > 0 for t in gpu_types.values())
    spot = {name.removesuffix("_spot") for name in gpu_types if name.endswith("_spot")}
    on_demand = {name.removesuffix("_ondemand") for name in gpu_types if name.endswith("_ondemand")}
    assert spot and spot == on_demand  # every spot type has its on-demand fallback
    for name in gpu_types:
        market = str(types[name]["node_config"])
        assert ("spot" in market.lower()) == name.endswith("_spot"), name

    head_start = " ".join(raw["head_start_ray_commands"])
    worker_start = " ".join(raw["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start  # never on a public interface
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert "~/.ray/auth_token" in raw["file_mounts"]
    scorer = re.search(r"RAY_AUTOSCALER_UTILIZATION_SCORER=(\S+)", head_start).group(1)
    from ray.autoscaler._private.loader import load_function_or_class

    assert load_function_or_class(scorer) is spot_first
    # The object store lives in /dev/shm: the containers' shm must hold it.
    store = int(re.search(r"--object-store-memory=(\d+)", worker_start).group(1))
    shm = re.search(r"--shm-size=(\d+)g", " ".join(raw["docker"]["worker_run_options"])).group(1)
    assert store < int(shm) * 2**30
    assert any("pip install" in c and "~/rayllm" in c for c in raw["worker_setup_commands"])  # installs rayllm
    assert raw["file_mounts"]["~/rayllm"] == "."
    assert ray.__version__ in raw["docker"]["image"]


def _ray_cluster_specs() -> list[tuple[str, dict]]:
    cluster = _load(KUBERAY / "raycluster.yaml")
    job = _load(KUBERAY / "rayjob.yaml")
    return [("RayCluster", cluster["spec"]), ("RayJob.rayClusterSpec", job["spec"]["rayClusterSpec"])]


@pytest.mark.parametrize("name,spec", _ray_cluster_specs(), ids=lambda x: x if isinstance(x, str) else "")
def test_kuberay_cluster_specs_carry_the_fields_the_crd_requires(name, spec):
    # The RayCluster CRD (ray.io/v1) requires headGroupSpec with a pod template, and per worker
    # group groupName, minReplicas, maxReplicas and a pod template; KubeRay before 1.4 also
    # required rayStartParams in both.
    head = spec["headGroupSpec"]
    assert "rayStartParams" in head and head["template"]["spec"]["containers"]
    for container in head["template"]["spec"]["containers"]:
        assert container["name"] and container["image"]
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True  # the autoscaler adds GPU workers as training asks
    assert spec["authOptions"]["mode"] == "token"
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"  # the dashboard stays inside the cluster
    groups = spec["workerGroupSpecs"]
    assert groups
    for group in groups:
        for key in ("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"):
            assert key in group, (name, group.get("groupName"), key)
        assert 0 <= group["minReplicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        assert container["name"] and container["image"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) > 0  # GPU worker groups
    assert {g["groupName"].rsplit("-", 1)[-1] for g in groups} == {"spot", "ondemand"}
    env = {e["name"]: e["value"] for e in spec["autoscalerOptions"]["env"]}
    assert env["RAY_AUTOSCALER_UTILIZATION_SCORER"] == "rayllm.autoscaler.spot_first"


def test_kuberay_manifests_have_kinds_names_and_a_job_entrypoint_that_runs_here():
    cluster = _load(KUBERAY / "raycluster.yaml")
    job = _load(KUBERAY / "rayjob.yaml")
    for manifest, kind in ((cluster, "RayCluster"), (job, "RayJob")):
        assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == kind
        assert manifest["metadata"]["name"]
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["submissionMode"] == "K8sJobMode"
    yaml.safe_load(spec["runtimeEnvYAML"])
    # The entrypoint is a job of this repo with a config that resolves, overrides included.
    python, script, config, *overrides = shlex.split(spec["entrypoint"])
    assert python == "python" and (REPO / script).is_file()
    TrainConfig.from_yaml(REPO / config, overrides=overrides)
    # The image the manifests name is built from Ray's image of the installed version.
    dockerfile = (REPO / "cluster" / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray.__version__}-" in dockerfile


PUBLISHED = {  # parameters, from the published configs (Llama: exact; GPT-2: within 1%)
    "llama-1b.yaml": (1_235_814_400, 0.0),  # Llama 3.2 1B
    "llama-1b-1gpu.yaml": (1_235_814_400, 0.0),  # the same on one GPU
    "llama-8b.yaml": (8_030_261_248, 0.0),  # Llama 3.1 8B
    "llama-70b.yaml": (70_553_706_496, 0.0),  # Llama 3.1 70B
    "llama-405b.yaml": (405_853_388_800, 0.0),  # Llama 3.1 405B
    "llama-8b-128k.yaml": (8_030_261_248, 0.0),  # Llama 3.1 8B at a 128k context
    "gpt2-124m.yaml": (124_439_808, 0.01),  # GPT-2 small (its learned positions and biases aside)
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_architectures_and_batches_that_fit_their_hardware(preset):
    config = TrainConfig.from_yaml(REPO / "configs" / preset)
    with torch.device("meta"):
        model = Llama(model_args(config))
    expected, tolerance = PUBLISHED[preset]
    assert abs(num_params(model) - expected) <= tolerance * expected, num_params(model)
    assert config.cluster.use_gpu
    lo, hi = config.worker_range
    # The ends of the elastic range lay out on whole 8-GPU nodes and keep the global batch; an
    # elastic run takes only such sizes in between (rayllm.runtime.ray_trainer.WholeLayoutsPolicy).
    t = config.train
    usable = usable_world_sizes(config.parallel, lo, hi, t.global_batch_size, t.micro_batch_size)
    assert lo in usable and hi in usable, usable
    for workers in usable:
        layout = resolve_layout(config.parallel, workers, ranks_per_node=8, n_params=expected, use_gpu=True)
        assert t.global_batch_size % (t.micro_batch_size * layout.dp) == 0, workers


def _availability(failed: list[str]):
    from ray.autoscaler._private.node_provider_availability_tracker import NodeProviderAvailabilityTracker
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    tracker = NodeProviderAvailabilityTracker()
    for node_type in failed:
        error = NodeLaunchException("InsufficientInstanceCapacity", "no spot capacity", None)
        tracker.update_node_availability(node_type, int(time.time()), error)
    return tracker.summary()


def test_spot_first_launches_spot_and_falls_back_to_on_demand_when_spot_launches_fail():
    from ray.autoscaler._private.resource_demand_scheduler import get_nodes_for

    raw = _load(REPO / "cluster" / "aws.yaml")
    types = raw["available_node_types"]
    eight_h100_workers = [{"CPU": 16, "GPU": 1, "gpu_h100": 1}] * 8

    def launch(failed: list[str], demand) -> dict:
        scorer = functools.partial(spot_first, node_availability_summary=_availability(failed))
        to_add, _ = get_nodes_for(types, {}, raw["head_node_type"], 10, demand, scorer)
        return dict(to_add)

    assert launch([], eight_h100_workers) == {"h100_spot": 1}
    assert launch(["h100_spot"], eight_h100_workers) == {"h100_ondemand": 1}
    # Data tasks that need no GPU never start a GPU node, spot or not.
    assert all(not types[t]["resources"].get("GPU") for t in launch([], [{"CPU": 1}]))


# --- the interruption notice reaches the run (rayllm/runtime/interruption.py) ---------------------

NOTICE_SCRIPT = "cluster/notice-on-stop.sh"
# A checkpoint of 8B (model + AdamW state: ~12 bytes per parameter, ~96 GB) at ~1 GB/s from one
# node: the least time a leaving worker pod must be given.
CHECKPOINT_S = 12 * PUBLISHED["llama-8b.yaml"][0] / 1e9


@pytest.mark.parametrize("name,spec", _ray_cluster_specs(), ids=lambda x: x if isinstance(x, str) else "")
def test_kuberay_worker_pods_deliver_the_notice_and_wait_for_the_checkpoint(name, spec):
    assert "COPY --chown=ray:users . /home/ray/rayllm" in (REPO / "cluster" / "Dockerfile").read_text()
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["RAYLLM_INTERRUPTION_NOTICE"] == "file", group["groupName"]
        # Kubernetes' default 30 s grace is shorter than a checkpoint; the hook's wait fits inside.
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= 2 * CHECKPOINT_S and int(env["RAYLLM_STOP_WAIT_S"]) < grace, (group["groupName"], grace)
        script, *_ = container["lifecycle"]["preStop"]["exec"]["command"]
        assert script == f"/home/ray/rayllm/{NOTICE_SCRIPT}"  # the image holds the repo there
    assert (REPO / NOTICE_SCRIPT).stat().st_mode & 0o111  # executable


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_worker_nodes_watch_their_clouds_notice_and_stop_only_after_the_checkpoint(path):
    raw = _load(path)
    cloud = raw["provider"]["type"]
    start = raw["worker_start_ray_commands"]
    assert f"RAYLLM_INTERRUPTION_NOTICE={cloud} " in start[-1]
    # A notice file from this instance's last stop (a restarted container) is no notice now.
    assert any(c.startswith("rm -f /tmp/rayllm/interruption-notice") for c in start[:-1])
    # The instance's shutdown runs the notice script inside the container, before docker stops it.
    (unit,) = [c for c in raw["initialization_commands"] if "rayllm-notice-on-stop.service" in c]
    assert "After=docker.service" in unit and "systemctl enable --now rayllm-notice-on-stop.service" in unit
    stop = re.search(r"ExecStop=/usr/bin/docker exec (\S+) (\S+)", unit)
    assert stop.group(1) == raw["docker"]["container_name"]
    assert stop.group(2) == f"/home/ray/rayllm/{NOTICE_SCRIPT}" and raw["file_mounts"]["~/rayllm"] == "."
    assert int(re.search(r"TimeoutStopSec=(\d+)", unit).group(1)) >= 2 * CHECKPOINT_S


def test_the_notice_script_writes_what_the_watcher_reads_and_waits_for_the_training_workers(tmp_path):
    import os
    import subprocess

    from rayllm.runtime.interruption import Watcher, WatchSettings

    notice = tmp_path / "rayllm" / "interruption-notice"
    env = {**os.environ, "RAYLLM_INTERRUPTION_FILE": str(notice), "RAYLLM_STOP_WAIT_S": "3"}
    # A stand-in training worker: its command line names RayTrainWorker, as Ray's process title does.
    worker = subprocess.Popen(["bash", "-c", "exec -a ray::RayTrainWorker.run_train_fn sleep 1"])
    started = time.monotonic()
    subprocess.run([REPO / NOTICE_SCRIPT, "the pod is being deleted"], env=env, check=True, timeout=30)
    waited = time.monotonic() - started
    worker.wait(timeout=5)
    assert 0.9 <= waited < 6, waited  # until the worker left (other Ray runs here: at most the 3 s cap)
    lines: list[str] = []
    seen = Watcher("node", WatchSettings(kind="file", file=str(notice)), log=lines.append).check()
    assert seen is not None and seen.detail.startswith("the pod is being deleted (")
    assert "interruption notice, notice file" in lines[0]
