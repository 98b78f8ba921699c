"""The cluster configs set up the network across GPU nodes as each cloud documents it. AWS: every
EFA card of a p5 (32) and p4d (4) node has an interface, the nodes launch into a cluster placement
group in one zone, the containers see the EFA devices and get the EFA software; KubeRay's H100 pods
request the EFA devices. GCP: an a3-highgpu-8g node has 5 gVNICs (the host network and 4 GPU
networks), a compact placement policy, Container-Optimized OS with the GPUDirect-TCPX receive-datapath
manager and NCCL plugin, and `ray start` runs with NCCL's TCPX settings; a2 nodes have the host
network only. Checked with Ray's own bootstrap steps (AWS's network interfaces; GCP's subnets and the
instance its node provider asks for, sent to a stand-in for the compute API) and by running the
commands' shell with stand-ins for docker and sudo."""

from __future__ import annotations

import copy
import os
import re
import subprocess
from types import SimpleNamespace

import yaml
from helpers import REPO

EFA_CARDS = {"p5.48xlarge": 32, "p4d.24xlarge": 4}


def _load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def test_aws_gpu_nodes_use_every_efa_card_in_one_zone_and_a_placement_group():
    from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces

    raw = _load(REPO / "cluster" / "aws.yaml")
    assert "," not in raw["provider"]["availability_zone"]  # EFA does not cross zones
    efa_types = 0
    for name, node_type in raw["available_node_types"].items():
        config = node_type["node_config"]
        cards = EFA_CARDS.get(config["InstanceType"])
        if cards is None:
            assert "NetworkInterfaces" not in config, name
            continue
        efa_types += 1
        interfaces = config["NetworkInterfaces"]
        assert [i["NetworkCardIndex"] for i in interfaces] == list(range(cards)), name
        assert [i["DeviceIndex"] for i in interfaces] == [0] + [1] * (cards - 1), name
        assert interfaces[0]["InterfaceType"] == "efa"  # card 0 also carries the node's IP traffic
        assert all(i["InterfaceType"] in ("efa", "efa-only") for i in interfaces), name
        assert config["Placement"]["GroupName"].startswith("rayllm-"), name
        # Ray's own step: every interface names a subnet and a security group.
        bootstrapped = _configure_subnets_and_groups_from_network_interfaces(copy.deepcopy(config))
        assert len(bootstrapped["SubnetIds"]) == cards
        options = " ".join(node_type["docker"]["worker_run_options"])
        assert "--device=/dev/infiniband" in options and "memlock=-1" in options and "--shm-size=" in options
        setup = " ".join(node_type["worker_setup_commands"])
        assert "efa_installer.sh" in setup and "pip install -q -e ~/rayllm" in setup
    assert efa_types == 4  # H100 and A100, spot and on-demand
    assert "/opt/amazon/ofi-nccl/lib" in " ".join(raw["worker_start_ray_commands"])


def test_kuberay_h100_pods_request_the_nodes_efa_devices_and_the_image_has_the_efa_software():
    cluster = _load(REPO / "cluster" / "kuberay" / "raycluster.yaml")["spec"]
    job = _load(REPO / "cluster" / "kuberay" / "rayjob.yaml")["spec"]["rayClusterSpec"]
    for spec in (cluster, job):
        for group in spec["workerGroupSpecs"]:
            (container,) = group["template"]["spec"]["containers"]
            assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32", group["groupName"]
            assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    dockerfile = (REPO / "cluster" / "Dockerfile").read_text()
    assert "efa_installer.sh -y -g --skip-kmod" in dockerfile and "/opt/amazon/ofi-nccl/lib" in dockerfile


TCPX_MACHINES = {"a3-highgpu-8g"}
NVIDIA_DEVICES = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidia-uvm", "/dev/nvidiactl"]


class _ComputeAPI:
    """Stands in for googleapiclient's compute client: records the instances Ray asks for."""

    _http = SimpleNamespace(credentials=None)

    def __init__(self):
        self.inserted: list[dict] = []

    def subnetworks(self):
        raise AssertionError("Ray looked up a subnet: some node type names no interfaces")

    def instances(self):
        return self

    def insert(self, **request):
        self.inserted.append(request)
        return self

    def execute(self, **_):
        return {"name": "operation-1"}


def _shell(script: str, tmp_path, name: str) -> tuple[str, list[list[str]]]:
    """Runs a script under bash, HOME a fresh folder, with stand-ins for docker, sudo and
    docker-credential-gcr that record their arguments (`docker start` finds no container);
    returns its output and the recorded calls."""
    home, bin_dir, calls = tmp_path / name, tmp_path / f"{name}-bin", tmp_path / f"{name}-calls"
    home.mkdir()
    bin_dir.mkdir()
    for tool in ("docker", "sudo", "docker-credential-gcr"):
        stub = bin_dir / tool
        no_container = '[ "$1" = start ] && exit 1\n' if tool == "docker" else ""
        stub.write_text(f'#!/bin/sh\nprintf "%s\\0" {tool} "$@" >> {calls}; echo >> {calls}\n{no_container}exit 0\n')
        stub.chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    recorded = calls.read_text().splitlines() if calls.exists() else []
    return out.stdout, [c.split("\0")[:-1] for c in recorded]


def _ray_start_env(raw: dict, setup: list[str], tmp_path, name: str) -> dict[str, str]:
    """The environment `ray start` gets on a worker node after the node type's setup commands
    (pip's excepted): what its raylet, and so Ray Train's workers, inherit."""
    start = raw["worker_start_ray_commands"][-1]
    before_ray = start[: start.index("ray start")]  # the shell and the variables ray start runs with
    script = "\n".join([c for c in setup if "pip install" not in c] + [before_ray + "env -0"])
    out, _ = _shell(script, tmp_path, name)
    return dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)


def test_gcp_h100_nodes_use_gpudirect_tcpx_and_the_a100_nodes_the_host_network_only(tmp_path):
    from ray.autoscaler._private.gcp.config import _configure_subnet, get_node_type
    from ray.autoscaler._private.gcp.node import GCPCompute, GCPNodeType
    from ray.autoscaler._private.util import prepare_config
    from ray.autoscaler.tags import TAG_RAY_NODE_NAME

    raw = _load(REPO / "cluster" / "gcp.yaml")
    provider = raw["provider"]
    region, project = provider["region"], provider["project_id"]
    assert "," not in provider["availability_zone"] and provider["availability_zone"].startswith(region)
    api = _ComputeAPI()
    # Ray's bootstrap keeps interfaces that are named, and with every node type naming them it looks
    # nothing up; then its node provider asks the compute API for each type's instance.
    config = _configure_subnet(prepare_config(copy.deepcopy(raw)), api)
    compute = GCPCompute(api, project, provider["availability_zone"], raw["cluster_name"])
    head_nic = raw["available_node_types"][raw["head_node_type"]]["node_config"]["networkInterfaces"][0]
    tcpx_types = 0
    for name, node_type in config["available_node_types"].items():
        node_config = node_type["node_config"]
        assert get_node_type(node_config) == GCPNodeType.COMPUTE
        compute.create_instance(node_config, {TAG_RAY_NODE_NAME: name.replace("_", "-")}, wait_for_operation=False)
        body = api.inserted[-1]["body"]
        nics = body["networkInterfaces"]
        # Ray reaches a node at its first interface: the head's network, with an external IP.
        assert (nics[0]["network"], nics[0]["subnetwork"]) == (head_nic["network"], head_nic["subnetwork"]), name
        assert nics[0]["accessConfigs"] and all(f"regions/{region}/" in n["subnetwork"] for n in nics), name
        if body["machineType"].rsplit("/", 1)[-1] not in TCPX_MACHINES:
            assert len(nics) == 1 and "resourcePolicies" not in body, name
            assert "docker" not in node_type and "initialization_commands" not in node_type, name
            continue
        tcpx_types += 1
        # 5 gVNICs, each on a network and a subnet of its own; the GPU NICs have no external IP.
        assert len(nics) == 5 and all(n["nicType"] == "GVNIC" for n in nics), name
        assert len({n["network"] for n in nics}) == 5 and len({n["subnetwork"] for n in nics}) == 5, name
        assert not any("accessConfigs" in n for n in nics[1:]), name
        (policy,) = body["resourcePolicies"]  # the compact placement policy
        assert re.fullmatch(rf"projects/{project}/regions/{region}/resourcePolicies/rayllm-a3-compact", policy)
        assert body["disks"][0]["initializeParams"]["sourceImage"].startswith("projects/cos-cloud/")

        # On the host: the driver, the receive-datapath manager and the plugin, as docker sees them.
        init = node_type["initialization_commands"]
        assert raw["initialization_commands"][0] in init  # the notice-on-stop unit, as on every node
        host = "set -e\n" + "\n".join(c for c in init if "rayllm-notice-on-stop" not in c)
        _, calls = _shell(host, tmp_path, f"{name}-host")
        assert ["sudo", "cos-extensions", "install", "gpu", "--", "--version=latest"] in calls
        (rxdm,) = [c for c in calls if c[:2] == ["docker", "run"] and "receive-datapath-manager" in c]
        assert rxdm[rxdm.index("--entrypoint") + 1] == "/tcpgpudmarxd/build/app/tcpgpudmarxd"
        assert {"--privileged", "--cap-add=NET_ADMIN", "--network=host", "--detach"} <= set(rxdm)
        assert rxdm[rxdm.index("--gpu_nic_preset") + 1] == "a3vm"
        assert rxdm[rxdm.index("--uds_path") + 1] == "/run/tcpx"
        assert rxdm[rxdm.index("--setup_param") + 1] == "--verbose 128 2 0"
        assert all(f"{d}:{d}" in rxdm for d in NVIDIA_DEVICES)
        (plugin,) = [c for c in calls if c[:2] == ["docker", "run"] and c[-2:] == ["install", "--install-nccl"]]
        assert plugin[-3].endswith("/gpudirect-tcpx/nccl-plugin-gpudirecttcpx") and "/var/lib:/var/lib" in plugin
        assert ["sudo", "iptables", "-I", "INPUT", "-p", "tcp", "-m", "tcp", "-j", "ACCEPT"] in calls

        # Ray's container: the GPUs, the driver's and the plugin's libraries, the RxDM's sockets.
        options = " ".join(node_type["docker"]["worker_run_options"])
        assert all(f"--device {d}:{d}" in options for d in NVIDIA_DEVICES), name
        for mount in ("/var/lib/nvidia/lib64:/usr/local/nvidia/lib64", "/var/lib/tcpx/lib64:/usr/local/tcpx/lib64"):
            assert f"--volume {mount}" in options, name
        assert "--volume /run/tcpx:/run/tcpx" in options and "--shm-size=" in options, name
        assert any("pip install -q -e ~/rayllm" in c for c in node_type["worker_setup_commands"])

        # ray start, and so Ray Train's workers, get NCCL's TCPX settings.
        env = _ray_start_env(raw, node_type["worker_setup_commands"], tmp_path, name)
        data_nics = env["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"].split(",")
        assert data_nics == ["eth1", "eth2", "eth3", "eth4"] and len(data_nics) == len(nics) - 1
        assert env["NCCL_SOCKET_IFNAME"] == env["NCCL_GPUDIRECTTCPX_CTRL_DEV"] == "eth0"
        assert env["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"] == "/run/tcpx"  # the RxDM's --uds_path
        for bindings in ("NCCL_GPUDIRECTTCPX_TX_BINDINGS", "NCCL_GPUDIRECTTCPX_RX_BINDINGS"):
            assert [b.split(":")[0] for b in env[bindings].split(";")] == data_nics, bindings
        assert {"/usr/local/nvidia/lib64", "/usr/local/tcpx/lib64"} <= set(env["LD_LIBRARY_PATH"].split(":"))
        assert env["RAYLLM_INTERRUPTION_NOTICE"] == "gcp"  # with the start command's own variables
        for key in ("NCCL_CROSS_NIC", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NET_GDR_LEVEL", "NCCL_P2P_NET_CHUNKSIZE"):
            assert env.get(key), key
    assert tcpx_types == 2  # spot and on-demand
    # The same start command on an A100 node, whose setup writes no TCPX settings, sets none.
    (a100,) = (
        {t["node_config"]["machineType"] for t in raw["available_node_types"].values()}
        - TCPX_MACHINES
        - {raw["available_node_types"][raw["head_node_type"]]["node_config"]["machineType"]}
    )
    assert not any(k.startswith("NCCL_") for k in _ray_start_env(raw, raw["worker_setup_commands"], tmp_path, "a100"))
