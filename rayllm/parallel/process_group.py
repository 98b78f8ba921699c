"""The default process group of a rank, set up one way for every entry point (torchrun, the
benchmarks): the device first, then the group bound to it, since NCCL's communicators are made
for the device that is current and a group without ``device_id`` puts collectives on GPU 0."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def local_device(use_gpu: bool, local_rank: int | None = None) -> torch.device:
    """This rank's device, made current: GPU ``LOCAL_RANK`` (or ``local_rank``), else the CPU."""
    if not use_gpu:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(
    device: torch.device,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
    timeout: timedelta | None = None,
) -> None:
    """Collective: NCCL on a GPU, gloo on the CPU. With ``rank``/``world_size``/``port`` the ranks
    meet on 127.0.0.1:port; without, the environment torchrun set (MASTER_ADDR, RANK, ...)."""
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    backend = "nccl" if device.type == "cuda" else "gloo"
    if rank is None:
        dist.init_process_group(backend, **kwargs)
    else:
        url = f"tcp://127.0.0.1:{port or free_port()}"
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size, **kwargs)
