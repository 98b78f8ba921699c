"""Ray Train's preemption watcher, built so that Ray can restart it: no actor handle among its
constructor's arguments.

Ray Train 2.60 starts one ``PreemptionWatcher`` actor per worker group (``max_restarts=-1``) with
the workers' actor handles as constructor arguments. Ray restarts an actor by running its
constructor again, which such arguments may not survive, and says so at every run
(ray-project/ray#53727: "has constructor arguments in the object store and max_restarts > 0").
The rank loop needs the watcher (a drained node's ranks checkpoint at the next step:
``RaySession.preempted``), so rayllm turns Ray's own off for its controller and adds this one:
the same watcher class, built empty and handed its worker group by a method call, and handed it
again whenever a poll finds that Ray restarted it empty.

Written against Ray Train's internal classes (no public hook builds the watcher); where they are
missing, Ray's own watcher stays, warning included.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENABLE_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train's switch for its own watcher

try:
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher
except ImportError:  # another Ray: its own watcher stays
    PreemptionCallback = PreemptionWatcher = None


if PreemptionWatcher is not None:

    class AttachedWatcher(PreemptionWatcher):
        """Ray Train's watcher, built with no arguments; ``watch`` hands it the worker group."""

        def __init__(self):  # noqa: D107 -- the parent's constructor runs in watch()
            self._latest_info = None
            self._monitor_thread = None

        def watch(self, node_to_ranks, poll_interval_s: float, worker_actors_by_rank) -> None:
            """Start watching (once: a repeated call is a no-op)."""
            if self._monitor_thread is None:
                super().__init__(node_to_ranks, poll_interval_s, worker_actors_by_rank)

        def watching(self) -> bool:
            return self._monitor_thread is not None

    class AttachedPreemptionCallback(PreemptionCallback):
        """Ray Train's preemption callback, starting an ``AttachedWatcher`` per worker group."""

        def __init__(self) -> None:
            super().__init__()
            self._group: tuple | None = None  # what watch() is handed
            self._probe = None  # a watching() call in flight

        def after_worker_group_start(self, worker_group) -> None:
            import ray

            self._stop_watcher()
            node_to_ranks: dict[str, list[int]] = {}
            by_rank = {}
            for w in worker_group.get_workers():
                rank = w.distributed_context.world_rank
                node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
                by_rank[rank] = w.actor
            self._group = (node_to_ranks, self._poll_interval_s, by_rank)
            self._watcher = ray.remote(num_cpus=0, max_restarts=-1)(AttachedWatcher).remote()
            self._watcher.watch.remote(*self._group)
            self._probe = None

        def after_worker_group_poll_status(self, worker_group_status) -> None:
            """A watcher Ray restarted comes back empty: hand it the group again. Never blocks the
            controller: the answer to one poll's question is read at a later poll."""
            import ray

            if self._watcher is None or self._group is None:
                return
            if self._probe is not None:
                ready, _ = ray.wait([self._probe], timeout=0)
                if not ready:
                    return
                try:
                    watching = ray.get(self._probe)
                except Exception:  # restarting: asked again at the next poll
                    watching = False
                if not watching:
                    self._watcher.watch.remote(*self._group)
            self._probe = self._watcher.watching.remote()

else:
    AttachedPreemptionCallback = None


def controller_callbacks() -> list:
    """The callbacks rayllm adds to Ray Train's controller: the watcher above, unless Ray Train's
    is turned off by the user (then none) or missing."""
    if AttachedPreemptionCallback is None or os.environ.get(ENABLE_ENV, "1").lower() in ("0", "false"):
        return []
    return [AttachedPreemptionCallback()]


@contextlib.contextmanager
def rays_own_watcher_off(replaced: bool) -> Iterator[None]:
    """Ray Train's controller reads its switch from the environment the driver hands it at start."""
    if not replaced:
        yield
        return
    before = os.environ.get(ENABLE_ENV)
    os.environ[ENABLE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENABLE_ENV, None)
        else:
            os.environ[ENABLE_ENV] = before
