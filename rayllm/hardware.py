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
