"""Under torchrun the other ranks wait while rank 0 prepares the data alone. On GPU the default
group is NCCL's, whose 10-minute timeout would end a slow but healthy start: the wait has a
gloo group and a deadline of its own. Here the default group gets a 2 s timeout in place of
NCCL's 10 minutes, and rank 0 takes 4 s."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayllm.parallel.process_group import free_port, init_group, long_barrier

pytestmark = pytest.mark.slow
DEFAULT_TIMEOUT_S, RANK0_TAKES_S = 2, 4


def _rank(rank: int, port: int, how: str, results) -> None:
    init_group(torch.device("cpu"), rank=rank, world_size=2, port=port, timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    try:
        wait = dist.barrier if how == "default" else long_barrier(3 * RANK0_TAKES_S if how == "own" else 1, "rank 0")
        if rank == 0:
            time.sleep(RANK0_TAKES_S)
        wait()
        results[rank] = "passed"
    except Exception as e:  # noqa: BLE001 - the outcome is what the test reads
        results[rank] = f"{type(e).__name__}: {e}"


def _run(how: str) -> dict:
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), how, results), nprocs=2, start_method="spawn", join=True)
    return dict(results)


def test_the_wait_for_rank_0_outlasts_the_default_groups_timeout():
    trapped = _run("default")[1]
    assert "timed out" in trapped.lower() or "timeout" in trapped.lower(), trapped  # the trap
    assert _run("own") == {0: "passed", 1: "passed"}


def test_the_wait_for_rank_0_ends_at_its_own_deadline_naming_what_it_waited_for():
    waited = _run("short")[1]
    assert waited.startswith("TimeoutError: waited 1 s for rank 0: "), waited
