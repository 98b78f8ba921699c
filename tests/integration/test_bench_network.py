"""rayllm.bench.network on two torchrun "nodes" of this machine (gloo): it times all-reduces
across the nodes with every rank at once and over the world, and flags a network slower than
half of what the planner assumes for the GPU named."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import free_port


def _node(rank: int, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={port}", "-m", "rayllm.bench.network", "--iters=2", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_are_timed_across_and_a_slow_network_is_named(tmp_path):
    out, port = tmp_path / "network.json", free_port()
    nodes = [_node(0, port, "--gpu=h100-80gb", f"--out={out}"), _node(1, port, "--gpu=h100-80gb")]
    codes = [node.wait(timeout=300) for node in nodes]
    result = json.loads(out.read_text())
    assert (result["nodes"], result["world_size"], result["backend"]) == (2, 2, "gloo")
    assert set(result["busbw_gb_per_s"]) == {"across nodes, every GPU at once", "world"}  # one rank a node
    for sizes in result["busbw_gb_per_s"].values():
        assert set(sizes) == {"1", "16", "256"} and all(v > 0 for v in sizes.values())
    # gloo over loopback is far below the 25 GB/s (half of 50) an H100 cluster's network must give.
    assert len(result["findings"]) == 1 and result["findings"][0].startswith("across nodes "), result["findings"]
    assert result["findings"][0].endswith("below 25 (half of what rayllm plan assumes)")
    assert codes == [1, 1]  # a finding is a failed check
