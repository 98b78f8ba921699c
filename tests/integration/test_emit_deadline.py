"""A rank's progress record never waits for ever on the driver's queue (runtime/ray_worker.py): with
the queue's actor process stopped (SIGSTOP, as a hung or swapped-out process is), a record is
dropped within its deadline, naming the wait, and the queue takes records again once it runs."""

import os
import signal
import time

from rayllm.runtime.ray_worker import send_record

RECORD = {"kind": "val", "step": 1, "val_loss": 2.0}


def test_a_record_the_drivers_queue_does_not_take_is_dropped_within_its_deadline(ray_local):
    from ray.util.queue import Queue

    queue = Queue()
    pid = ray_local.get(queue.actor.__ray_call__.remote(lambda actor: os.getpid()), timeout=60)
    assert send_record(queue, RECORD, 30) is None
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        error = send_record(queue, RECORD, 1.0)
        assert error == "the driver's queue took no record in 1 s"
        assert time.monotonic() - started < 10
    finally:
        os.kill(pid, signal.SIGCONT)
    assert send_record(queue, RECORD, 30) is None
    assert queue.get(timeout=30) == RECORD
    queue.shutdown()
