"""The hang watchdog's rules and the straggler rule, without processes (the end-to-end checks are in
test_torchrun.py's 4 -> 2 -> 4 run and test_exactly_once.py's Ray run)."""

import sys
import threading
import time

import pytest

from rayllm.config import TrainConfig
from rayllm.loop.watchdog import SLOW_PHASE_S, step_deadline, summary_line, wait_fraction, where
from rayllm.runtime.stragglers import Stragglers


def test_the_deadline_is_the_configured_one_or_a_multiple_of_the_median_step_with_a_floor():
    config = TrainConfig.from_yaml("configs/tiny.yaml", ["train.hang_factor=10", "train.hang_min_s=120"])
    assert step_deadline(config, []) == SLOW_PHASE_S  # no step measured yet: start-up
    assert step_deadline(config, [0.1, 0.2, 50.0]) == 120  # 10 x 0.2 s is under the floor
    assert step_deadline(config, [20.0, 30.0, 25.0]) == 250
    config.train.hang_timeout_s = 7.0
    assert step_deadline(config, [20.0]) == 7.0


def test_a_thread_is_running_or_waiting_where_its_stack_says():
    started = threading.Event()

    def sleeper():
        started.set()
        time.sleep(5)

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    started.wait()
    state, place = where(sys._current_frames()[thread.ident])
    assert state == "running" and "sleeper" in place and "test_watchdog.py" in place


def test_the_summary_names_the_running_rank_and_who_waited():
    reports = [
        {"rank": 0, "node": "a", "step": 9, "state": "collective", "place": "wait (distributed_c10d.py:1)"},
        {"rank": 1, "node": "b", "step": 9, "state": "running", "place": "maybe_hang (faults.py:90)"},
        {"rank": 2, "node": "a", "step": 9, "state": "data", "place": "steps (serve.py:3)"},
    ]
    line = summary_line(reports, 3, 12.4, 10.0, "runs/x/hangs/attempt-1")
    assert line.startswith("hang: no step finished for 12 s (deadline 10 s): rank 1 on node b (maybe_hang")
    assert "did not reach the end of step 10; ranks 0, 2 waited for it" in line
    # Nobody running: a rank waiting for data is the one that did not arrive.
    fed = summary_line([reports[0], reports[2]], 2, 12, 10, "x")
    assert "rank 2 on node a (steps (serve.py:3))" in fed and "; rank 0 waited for it" in fed
    # Nobody running or waiting for data: the rank that never reported is the one to look at.
    waiting = [dict(r, state="collective") for r in reports[:2]]
    assert "rank 2 on node ? (no report)" in summary_line(waiting, 3, 12, 10, "x")


def test_on_nccl_the_rank_that_issued_fewer_collectives_is_named_though_every_rank_reads_as_running():
    """NCCL's collectives return at once: every rank waits in a read of its step's numbers, so
    every stack reads "running". The flight recorder's counts say who never issued the collective
    the others wait in: rank 2 in the world group; in its TP pair ("1"), rank 3 waits for it."""
    groups = {"0": [0, 1, 2, 3], "1": [2, 3], "2": [0, 1]}
    place = "_read_steps (trainer.py:370)"
    reports = [
        {"rank": r, "node": "ab"[r // 2], "step": 9, "state": "running", "place": place}
        | {"issued": issued, "groups": {g: groups[g] for g in issued}}
        for r, issued in enumerate([{"0": 41, "2": 12}, {"0": 41, "2": 12}, {"0": 40, "1": 7}, {"0": 41, "1": 8}])
    ]
    line = summary_line(reports, 4, 130, 120, "x")
    assert f"rank 2 on node b ({place}) did not reach the end of step 10; ranks 0, 1, 3 waited for it" in line
    # Counts that agree name nobody by themselves: the stacks decide, as without counts.
    level = [dict(r, issued={g: 5 for g in r["issued"]}) for r in reports]
    level[1] = dict(level[1], state="collective")
    assert "rank 0 on node a" in summary_line(level, 4, 130, 120, "x")


def test_on_nccl_a_ranks_wait_is_its_timed_collectives_share_of_the_window():
    """The flight recorder's entries as NCCL writes them with TORCH_NCCL_ENABLE_TIMING: the window's
    timed collectives over its length; a full ring covers only its own span; none timed: None."""
    s = 1_000_000_000
    entries = [
        {"time_created_ns": 9 * s, "duration_ms": 500.0},  # before the window
        {"time_created_ns": 11 * s, "duration_ms": 1500.0},
        {"time_created_ns": 13 * s, "duration_ms": 500.0},
        {"time_created_ns": 14 * s},  # still running: not timed yet
    ]
    assert wait_fraction(entries, 10 * s, 20 * s) == pytest.approx(0.2)  # 2 s of 10
    assert wait_fraction(entries[1:], 5 * s, 21 * s) == pytest.approx(0.2)  # the ring begins at 11 s
    assert wait_fraction([{"time_created_ns": 11 * s}], 10 * s, 20 * s) is None  # gloo: no timing
    assert wait_fraction([], 10 * s, 20 * s) is None


def test_a_rank_is_a_straggler_only_when_slow_in_consecutive_windows():
    stragglers = Stragglers(factor=1.5, windows=2)
    assert stragglers.update([0.10, 0.30, 0.11]) == {}  # slow once: not yet
    assert stragglers.update([0.10, 0.31, 0.11]) == {1: 0.31 / 0.11}
    assert stragglers.update([0.10, 0.11, 0.11]) == {}  # back in line
    assert stragglers.update([0.01, 0.03, 0.01]) == {}  # 3x, but by 20 ms: noise
    assert stragglers.update([0.01, 0.03, 0.01]) == {}


def test_an_in_memory_save_has_a_steps_deadline_not_a_slow_phases(tmp_path):
    """In-memory checkpoints come as often as every step: a peer lost inside one (stopped, killed)
    must be a hang within the step's deadline, not after the 30-minute slow phase. The first save,
    which starts the keepers, still gets a slow phase's; a slow save stretches its own deadline."""
    from types import SimpleNamespace

    from rayllm.loop.trainer import MEMORY_SAVE_FACTOR, Trainer
    from rayllm.loop.watchdog import HangWatchdog

    config = TrainConfig()
    config.run.dir = str(tmp_path)
    config.train.hang_timeout_s = 15.0
    dog = HangWatchdog(config, 0, 1, "here", 1, emit=lambda event: None)
    try:
        dog.beat(1, 0.5)  # the first step: start-up is over
        trainer = SimpleNamespace(checkpointer=SimpleNamespace(memory_save_s=None))
        assert Trainer._memory_save_deadline(trainer, dog) == SLOW_PHASE_S
        trainer.checkpointer.memory_save_s = 0.5
        assert Trainer._memory_save_deadline(trainer, dog) == 15.0
        trainer.checkpointer.memory_save_s = 4.0
        assert Trainer._memory_save_deadline(trainer, dog) == 4.0 * MEMORY_SAVE_FACTOR
    finally:
        dog.stop()


STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timedelta(seconds=60), wait_for_workers=False)
print("serving", flush=True)
time.sleep(120)
"""


def test_the_hang_report_is_gathered_within_its_deadline_when_the_stores_host_is_the_stopped_rank():
    """The process group's store is served from rank 0's process: with rank 0 stopped (SIGSTOP, as a
    hung or frozen process), a store call never returns. The peer that fires must still say what it
    knows within the gather's deadline, not sit out the fire limit (120 s) without a line."""
    import os
    import signal
    import subprocess
    from datetime import timedelta

    import torch.distributed as dist

    from rayllm.loop.watchdog import ReportGather
    from rayllm.parallel.process_group import free_port

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "serving"
        store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
        store.set("alive", "1")
        os.kill(host.pid, signal.SIGSTOP)
        started = time.monotonic()
        reports = ReportGather(store, {"rank": 1, "step": 7}, 1, 2, "hang/1", within_s=1.0).reports()
        assert reports == [{"rank": 1, "step": 7}]
        assert time.monotonic() - started < 5.0, "bounded by the gather's deadline, not the store's timeout"
    finally:
        os.kill(host.pid, signal.SIGKILL)
        host.wait(timeout=10)


def test_the_hang_reports_of_live_ranks_are_gathered_as_soon_as_all_are_in():
    """Each rank posts its report before writing its dumps; a gather ends when every rank's report is
    in, not at its deadline, and names each rank once."""
    from datetime import timedelta

    import torch.distributed as dist

    from rayllm.loop.watchdog import ReportGather
    from rayllm.parallel.process_group import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=30), wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", port, 3, False, timedelta(seconds=30)) for _ in range(2)]
    started = time.monotonic()
    gathers = [
        ReportGather(store, {"rank": rank}, rank, 3, "hang/2", within_s=20.0)
        for rank, store in enumerate([server, *clients])
    ]
    assert [g.reports() for g in gathers] == [[{"rank": 0}, {"rank": 1}, {"rank": 2}]] * 3
    assert time.monotonic() - started < 5.0, "ended when all were in, not at the 20 s deadline"
