"""The cluster configs set up the network across GPU nodes as AWS documents it: every EFA card
of a p5 (32) and p4d (4) node has an interface, the nodes launch into a cluster placement group
in one zone, the containers see the EFA devices and get the EFA software; KubeRay's H100 pods
request the EFA devices. Checked with Ray's own AWS bootstrap step for network interfaces."""

from __future__ import annotations

import copy

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
