"""Keep every M-th checkpoint (``train.keep_checkpoint_every``) beside the last K.

Ray Train keeps the last K checkpoints it has registered and, on resume, fails if one it
lists is gone, so rayllm cannot spare some of them from its deletion or delete others itself.
Instead a checkpoint at a multiple of M steps is copied to ``run.dir/kept/`` once Ray Train has
registered it (it is then complete), before it falls out of the last K. Under torchrun the
commit copies it there.
"""

from __future__ import annotations

import json
import logging
import posixpath
import threading

from rayllm.config import TrainConfig
from rayllm.storage import filesystem, join, read_text

KEPT_DIR = "kept"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of registered checkpoints
log = logging.getLogger(__name__)


def is_milestone(step: int, every: int | None) -> bool:
    return bool(every) and step > 0 and step % every == 0


class MilestoneKeeper:
    """On the driver: copies registered milestone checkpoints in a thread of its own."""

    def __init__(self, config: TrainConfig, poll_s: float = 0.5):
        self.config, self.poll_s = config, poll_s
        self.every = config.train.keep_checkpoint_every
        self._wanted: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.kept: list[str] = []
        self._thread = None
        if self.every:
            self._thread = threading.Thread(target=self._loop, name="rayllm-milestones", daemon=True)
            self._thread.start()

    def saw_checkpoint(self, step: int) -> None:
        """A rank-0 checkpoint record: copy it once registered, when it is a milestone."""
        if is_milestone(step, self.every):
            with self._lock:
                self._wanted.add(step)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.copy_registered()

    def copy_registered(self) -> None:
        with self._lock:
            wanted = set(self._wanted)
        if not wanted:
            return
        storage, run_dir = self.config.data.storage, self.config.run.dir
        try:
            text = read_text(join(run_dir, SNAPSHOT), storage)
            registered = {r["checkpoint_dir_name"] for r in json.loads(text or "{}").get("checkpoint_results", [])}
            fs, root = filesystem(run_dir, storage)
            for step in sorted(wanted):
                name = f"checkpoint_{step:08d}"
                if name not in registered:
                    continue
                target = posixpath.join(root, KEPT_DIR, name)
                if not fs.exists(target):
                    fs.makedirs(posixpath.join(root, KEPT_DIR), exist_ok=True)
                    fs.copy(posixpath.join(root, name), target + ".tmp", recursive=True)
                    fs.mv(target + ".tmp", target, recursive=True)  # complete, or not under its name
                self.kept.append(join(run_dir, KEPT_DIR, name))
                with self._lock:
                    self._wanted.discard(step)
        except Exception as e:  # keeping milestones must never stop training; try again next poll
            log.warning("could not keep a milestone checkpoint yet: %s", e)

    def close(self) -> None:
        """At the end of the run: the last registrations are in, copy what is still wanted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.copy_registered()
