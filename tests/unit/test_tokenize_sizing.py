"""Tokenize tasks sized to the run: the sizing rule (TaskSizer) on a simulated clock, without Ray
(the tasks themselves: tests/integration/test_tokenize_pool.py)."""

from rayllm.data import encode
from rayllm.data.encode import HEADROOM, SIZE_PERIOD_S, TaskSizer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _period(sizer, clock, *, taken, task_bytes, task_seconds, idle):
    """One sizing period in which the stream took ``taken`` bytes and the reader waited ``idle`` s."""
    sizer.taken(taken)
    sizer.tokenized(task_bytes, task_seconds)
    sizer.waited_for_consumer(idle)
    clock.now += SIZE_PERIOD_S
    return sizer.update()


def test_tasks_follow_the_demand_and_the_per_task_rate_up_to_the_ceiling():
    clock = Clock()
    sizer = TaskSizer(ceiling=8, clock=clock)
    per_task = 1_000_000  # bytes a task tokenizes per second
    for demand, expected in [(10_000, 0), (900_000, 2), (3_000_000, 4), (50_000_000, 8), (100_000, 0)]:
        # The reader waits for its consumer half the time: the demand is what the stream took.
        got = _period(
            sizer,
            clock,
            taken=demand * SIZE_PERIOD_S,
            task_bytes=per_task,
            task_seconds=1.0,
            idle=SIZE_PERIOD_S / 2,
        )
        assert got == expected == min(8, 0 if HEADROOM * demand / per_task < 0.5 else -(-HEADROOM * demand // per_task))


def test_a_reader_that_never_waits_adds_tasks_while_they_pay_and_steps_back_when_they_do_not():
    clock = Clock()
    sizer = TaskSizer(ceiling=16, clock=clock)

    def bottleneck(rate):
        return _period(sizer, clock, taken=rate * SIZE_PERIOD_S, task_bytes=1, task_seconds=1e-6, idle=0.0)

    assert bottleneck(1e6) == 2  # from tokenizing alone straight to two tasks
    assert bottleneck(1e6) == 2  # the period after a step is not judged (task workers start)
    assert bottleneck(2e6) == 3  # doubled: step up again
    assert bottleneck(2e6) == 3
    assert bottleneck(2.1e6) == 2  # +5%: the CPUs are saturated; back to what paid
    for _ in range(int(encode.SATURATED_HOLD_S / SIZE_PERIOD_S) - 1):
        assert bottleneck(2e6) == 2  # held there ...
    assert bottleneck(2e6) == 3  # ... then probed again
