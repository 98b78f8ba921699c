"""Run a stream ahead in a thread, so the next batch is prepared while the step runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


def prefetched(iterator: Iterator[T], depth: int = 2) -> Iterator[T]:
    """Items of ``iterator``, produced by a daemon thread up to ``depth`` ahead; errors re-raised here."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill() -> None:
        try:
            for item in iterator:
                items.put(item)
            items.put(done)
        except BaseException as e:  # handed to the consumer, which raises it
            items.put(e)

    threading.Thread(target=fill, daemon=True, name="rayllm-prefetch").start()
    while True:
        item = items.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item
