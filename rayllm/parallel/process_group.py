"""The default process group of a rank, set up one way for every entry point (torchrun, the
benchmarks): the device first, then the group bound to it, since NCCL's communicators are made
for the device that is current and a group without ``device_id`` puts collectives on GPU 0."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# What every GPU rank's process gets unless its user set it; read when CUDA starts, so set before.
GPU_ENV_DEFAULTS = {
    # Segments that grow in place, not new blocks for each size: multi-GB logits and varying
    # activation sizes fragment the caching allocator less (torchtitan sets it too).
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    # NCCL's flight recorder keeps the last collectives, which a hang's dump includes, each timed
    # on the GPU: the straggler watch reads how long each rank waited in them (rayllm.loop.watchdog).
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_ENABLE_TIMING": "1",
}


def gpu_env() -> dict[str, str]:
    """GPU_ENV_DEFAULTS, each as the user's environment sets it if it does."""
    return {name: os.environ.get(name, value) for name, value in GPU_ENV_DEFAULTS.items()}


def local_device(use_gpu: bool, local_rank: int | None = None) -> torch.device:
    """This rank's device, made current: GPU ``LOCAL_RANK`` (or ``local_rank``), else the CPU."""
    if not use_gpu:
        return torch.device("cpu")
    os.environ.update(gpu_env())  # before CUDA starts in this process (Ray's workers: launch.py)
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


def long_barrier(seconds: float, waiting_for: str) -> Callable[[], None]:
    """Collective, now: a gloo group of its own; then the returned ``wait()``, collective too, is a
    barrier on it that ends after ``seconds`` with an error naming ``waiting_for``. For a wait
    longer than the default group's timeout, which on GPU is NCCL's 10 minutes: its watchdog
    would end a slow but healthy start (rank 0 preparing the data alone) as a failed collective.
    Made before the wait begins: making a group is itself collective."""
    if dist.get_world_size() == 1:
        return lambda: None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))

    def wait() -> None:
        try:
            dist.barrier(group=group)
        except RuntimeError as e:
            raise TimeoutError(f"waited {seconds:.0f} s for {waiting_for}: {str(e).splitlines()[0][:200]}") from e
        finally:
            dist.destroy_process_group(group)

    return wait
