"""One SIGTERM/SIGINT handler for every process of a run: the driver, torchrun ranks, Ray workers.

The first signal asks for a checkpoint at the next step (a spot reclaim, ``kubectl drain``,
``ray job stop`` and Ctrl-C all send one); the process's own role decides what follows (the
driver ends the run, a Ray worker's checkpoint is followed by the restart the run already
does). A second signal ends the process at once.

Handlers can be installed only in a process's main thread. Ray Train runs the training
function in a thread of its own, so Ray workers install it at process start through Ray's
``worker_process_setup_hook`` (``install_in_worker``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The first SIGTERM/SIGINT sets ``requested`` (and calls ``on_first``); a second one exits."""

    def __init__(self, on_first: Callable[[str], None] | None = None):
        self.requested = threading.Event()
        self.name: str | None = None
        self._on_first = on_first
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested.is_set():
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            sys.exit(128 + signum)
        self.name = signal.Signals(signum).name
        self.requested.set()
        if self._on_first is not None:
            self._on_first(self.name)

    def install(self) -> bool:
        """Install in this process; False (nothing done) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return True

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


WORKER = StopSignals()  # a Ray training worker's: the loop reads it at every step


def install_in_worker() -> None:
    """Ray's worker_process_setup_hook: every training worker process of a run gets the handler.

    Ray's worker main loop installs its own SIGTERM handler (exit at once) right after this
    hook has run, through ``ray._private.utils.set_sigterm_handler``; in this process that
    call is made to keep rayllm's handler, since Ray offers no setting for it. A second
    SIGTERM still exits, and Ray's own SIGKILL escalation is untouched.
    """
    WORKER.install()
    import ray._private.utils as ray_utils

    def keep_rayllm_handler(handler) -> None:
        return None

    ray_utils.set_sigterm_handler = keep_rayllm_handler
