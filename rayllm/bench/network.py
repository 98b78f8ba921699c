"""``python -m rayllm.bench.network``: whether the cluster's network is what the planner assumes.

Run it under torchrun on the nodes a training run will use, one process per GPU:

    NCCL_DEBUG=INFO torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD_IP:29500 -m rayllm.bench.network --gpu h100-80gb --out network.json

It times all-reduces three ways, as nccl-tests counts them (bus bandwidth: 2 (n - 1) / n of the
bytes each rank sends, per second): inside each node, across the nodes with every GPU at once
(each local rank with its peers on the other nodes, all groups together: what FSDP across nodes
does), and over the whole world. With NCCL it also names the transport NCCL chose between the
nodes, read from its own log: "Socket" means TCP, a small fraction of the 50 GB/s per GPU that
EFA (p5, "AWS Libfabric"), InfiniBand ("IB") or GPUDirect-TCPX give, and the planner assumes.
On CPU (gloo) the same code runs and the figures are gloo's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rayllm.parallel.gpus import GPUS
from rayllm.parallel.process_group import init_group, local_device

SIZES_MB = (1, 16, 256)  # the largest is what FSDP's per-block collectives move at 8B and up
GOAL_SHARE = 0.5  # across nodes, at least half the planner's per-GPU figure at the largest size
_TRANSPORT = re.compile(r"via NET/([^/\n]+)/")


def bus_bandwidth(group: dist.ProcessGroup | None, nbytes: int, device: torch.device, iters: int) -> float:
    """Bytes per second of an all-reduce of ``nbytes`` over ``group``, nccl-tests' bus bandwidth."""
    n = dist.get_world_size(group)
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # (nbytes / 4,)
    dist.all_reduce(data, group=group)  # warm-up: connections, buffers
    dist.barrier(group=group)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data, group=group)
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    return 2 * (n - 1) / n * nbytes / seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def node_groups(world: int, per_node: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Collective: (this rank's node, this rank's peers on the other nodes at its local rank), or
    None where that group would be one rank. Every rank creates every group, in one order."""
    rank, nodes = dist.get_rank(), world // per_node
    intra = inter = None
    for node in range(nodes):
        group = dist.new_group(list(range(node * per_node, (node + 1) * per_node)))
        intra = group if rank // per_node == node and per_node > 1 else intra
    for local in range(per_node):
        group = dist.new_group(list(range(local, world, per_node)))
        inter = group if rank % per_node == local and nodes > 1 else inter
    return intra, inter


def transport(log_dir: Path) -> str | None:
    """The network NCCL used between nodes, from the NCCL_DEBUG=INFO lines in ``log_dir``."""
    seen = set()
    for path in log_dir.glob("nccl.*"):
        seen.update(_TRANSPORT.findall(path.read_text(errors="replace")))
    return ", ".join(sorted(seen)) or None


def measure(device: torch.device, per_node: int, iters: int) -> dict[str, Any]:
    """Collective: bus bandwidth in GB/s by scope and size (MB)."""
    world = dist.get_world_size()
    intra, inter = node_groups(world, per_node)
    scopes = {"inside a node": intra, "across nodes, every GPU at once": inter, "world": None}
    result: dict[str, Any] = {"world_size": world, "nodes": world // per_node, "busbw_gb_per_s": {}}
    for scope, group in scopes.items():
        if scope != "world" and group is None:
            dist.barrier()  # one rank on this side: nothing to time, but keep the ranks together
            continue
        sizes = {str(mb): bus_bandwidth(group, mb * 2**20, device, iters) / 1e9 for mb in SIZES_MB}
        gathered: list[dict] = [{}] * world
        dist.all_gather_object(gathered, sizes)  # the slowest rank's figure is the scope's
        result["busbw_gb_per_s"][scope] = {mb: min(g[mb] for g in gathered) for mb in sizes}
    return result


def judge(result: dict[str, Any], gpu: str | None) -> list[str]:
    """Findings, one line each; none when the network is what the planner assumes."""
    across = result["busbw_gb_per_s"].get("across nodes, every GPU at once")
    found = []
    net = result.get("transport") or ""
    if result["nodes"] > 1 and result["backend"] == "nccl" and ("Socket" in net or not net):
        found.append(
            f"NCCL uses {net or 'an unknown transport'} between nodes: TCP sockets, not EFA/InfiniBand/TCPX "
            "(see README, 'Networking across nodes')"
        )
    if gpu and across:
        goal = GOAL_SHARE * GPUS[gpu].inter_node_bytes_per_s / 1e9
        got = across[str(SIZES_MB[-1])]
        if got < goal:
            found.append(f"across nodes {got:.1f} GB/s per GPU, below {goal:.0f} (half of what rayllm plan assumes)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayllm.bench.network", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), help="the GPU whose planner figures to check against")
    parser.add_argument("--iters", type=int, default=20, help="all-reduces timed per size")
    parser.add_argument("--out", help="write the figures as JSON here (rank 0)")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="rayllm-nccl-"))
    os.environ.setdefault("NCCL_DEBUG", "INFO")  # the transport is read from NCCL's own log
    os.environ.setdefault("NCCL_DEBUG_FILE", str(log_dir / "nccl.%h.%p"))
    device = local_device(torch.cuda.is_available(), int(os.environ.get("LOCAL_RANK", 0)))
    init_group(device)
    try:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        result = measure(device, per_node, args.iters)
        result["backend"] = dist.get_backend()
        names: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(names, transport(log_dir))
        result["transport"] = ", ".join(sorted({n for n in names if n})) or None
    finally:
        dist.destroy_process_group()
    result["findings"] = judge(result, args.gpu)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    return 1 if result["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
