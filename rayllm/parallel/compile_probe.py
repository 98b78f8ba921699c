"""Whether ``torch.compile`` can work on this rank, agreed by every rank before any block is
compiled: a missing or broken toolchain (no C++ compiler for Inductor on CPU, no Triton or
Python headers on GPU) falls back to eager with one warning instead of ending the run.

The probe builds and runs a small function's forward and backward with Inductor, the backend
the blocks use, so it fails where the blocks would fail for want of a toolchain, in seconds and
outside any collective. Every rank must take the same path (a rank that fell back alone would
compute with other kernels than its TP peers), so the ranks agree: eager if any rank failed.
A model-specific compile error is not caught: it is the same on every rank, and a bug to report.
A probe that has not finished by its deadline (a compiler that hangs) counts as failed: the
model's own compile would hang too, and nothing waits for ever.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayllm.parallel.apply import should_compile

# A first Inductor build takes seconds to a minute (longer on a busy node); the tests shorten it.
PROBE_TIMEOUT_S = float(os.environ.get("RAYLLM_COMPILE_PROBE_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class CompileChoice:
    """What the ranks agreed: compile or not, and why not when compile was asked for."""

    compile: bool
    fallback: str | None = None  # the cause, when compile was asked for and eager was agreed


def probe(device: torch.device, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when Inductor can build and run a forward and backward on ``device`` within
    ``timeout_s``; else the cause in one line. The build runs in a daemon thread, left behind
    if it hangs (the run goes on eager and never compiles)."""
    box: list[str | None] = []
    thread = threading.Thread(target=lambda: box.append(_build_and_run(device)), daemon=True, name="compile-probe")
    thread.start()
    thread.join(timeout_s)
    if not box:
        return f"a test compile did not finish in {timeout_s:.0f} s (a compiler that hangs?)"
    return box[0]


def _build_and_run(device: torch.device) -> str | None:
    try:
        x = torch.randn(16, device=device, requires_grad=True)  # (16,)
        # A fresh function each call: a cached graph would skip the build being probed.
        compiled = torch.compile(lambda t: (t * 2.0).sin().sum(), fullgraph=True, dynamic=False)
        compiled(x).backward()
        return None
    except Exception as e:  # the probe's purpose: any failure to compile names the cause
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first}"[:300]


def agree_on_compile(setting: bool | str, device: torch.device) -> CompileChoice:
    """``train.compile`` on ``device``; collective when it asks for compile (every rank asks the
    same): compile if every rank's probe passed, else eager with the first failing rank's cause."""
    if not should_compile(setting, device):
        return CompileChoice(compile=False)
    cause = probe(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        causes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(causes, cause)
        failed = [(rank, c) for rank, c in enumerate(causes) if c is not None]
        cause = f"rank {failed[0][0]}: {failed[0][1]}" if failed else None
    if cause is None:
        return CompileChoice(compile=True)
    return CompileChoice(
        compile=False,
        fallback=f"train.compile: torch.compile does not work here ({cause}); training eager, which is "
        "slower. Install what torch.compile needs (a C++ compiler on CPU; Triton on GPU) or set train.compile: false",
    )
