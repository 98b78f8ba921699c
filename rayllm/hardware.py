"""The machine's own matmul peak, measured, as the denominator of MFU.

Datasheet peaks say little on a CPU (turbo, AVX width, memory) and overstate a GPU behind a
power cap, so rayllm measures: square matmuls of the training dtype (fp32 on CPU, bf16 on
GPU), as many as fit in a short time, with the threads the worker trains with. MFU is the
training's achieved FLOP/s over this figure: how much of what this machine's matmul reaches
the training loop gets.
"""

from __future__ import annotations

import time

import torch


def matmul_peak_flops(device: torch.device, dtype: torch.dtype | None = None, seconds: float = 0.5) -> float:
    """FLOP/s of ``n x n @ n x n`` on ``device``: the best of a few timed rounds after a warm-up."""
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    n = 8192 if cuda else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    torch.matmul(a, b)  # warm-up: kernels chosen, memory touched
    sync()
    best = 0.0
    deadline = time.perf_counter() + seconds
    reps = 1
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        elapsed = time.perf_counter() - start
        best = max(best, 2.0 * n**3 * reps / elapsed)
        if elapsed < 0.05:
            reps *= 2
    return best


def keep_freed_memory() -> bool:
    """Stop glibc's malloc from handing large freed blocks back to the kernel (Linux only).

    A training step on CPU allocates and frees the same large activations every step. By
    default glibc serves each one above a threshold with a fresh ``mmap`` and unmaps it when
    freed, so every step pays page faults and the kernel's zeroing of those pages again: 10%
    of the tiny config's step. Keeping them in the heap is what PyTorch's CUDA caching
    allocator does on GPU; on CPU PyTorch leaves it to malloc, and the usual remedy (jemalloc
    or tcmalloc through LD_PRELOAD) must be set before the process starts, which a Ray worker
    cannot do for itself. So this sets glibc's own knobs once, at run time, with ``mallopt``.
    Resident memory then stays at its peak instead of falling between steps.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl): its malloc keeps its defaults
        return False


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_bytes() -> int:
    """This process's resident memory now."""
    found = _proc_status_bytes("VmRSS")
    if found is not None:
        return found
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_resident_bytes() -> int:
    """This process's peak resident memory (since start, or since ``reset_peak_resident``).

    Linux's VmHWM, not ``getrusage``'s maxrss: maxrss carries a parent's peak across fork and
    exec, so a freshly spawned worker would report the peak of the process that started it.
    """
    found = _proc_status_bytes("VmHWM")
    if found is not None:
        return found
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_resident() -> bool:
    """Start ``peak_resident_bytes`` again from the current resident memory (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
