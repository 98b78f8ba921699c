"""Ray Train's preemption watcher as rayllm builds it (runtime/preemption.py), on a real local Ray: no
actor handle among its constructor's arguments (ray#53727), handed its worker group by a call, and
handed it again once Ray has restarted it after its process was killed."""

import os
import signal
import time
from types import SimpleNamespace


def test_the_watcher_is_handed_its_worker_group_by_a_call_and_again_after_ray_restarts_it(ray_local):
    ray = ray_local
    from rayllm.runtime.preemption import AttachedPreemptionCallback

    @ray.remote(num_cpus=0)
    class Worker:  # a training worker's one method the watcher calls
        def mark_preempt(self, info) -> None:
            pass

    worker = Worker.remote()
    node = ray.get_runtime_context().get_node_id()
    member = SimpleNamespace(
        distributed_context=SimpleNamespace(world_rank=0), metadata=SimpleNamespace(node_id=node), actor=worker
    )
    group = SimpleNamespace(get_workers=lambda: [member])  # what Ray Train's worker group gives its callbacks
    callback = AttachedPreemptionCallback()
    callback.after_worker_group_start(group)
    watcher = callback._watcher
    assert ray.get(watcher.watching.remote(), timeout=60)
    pid = ray.get(watcher.__ray_call__.remote(lambda w: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGKILL)  # Ray restarts it by running its constructor again: empty
    deadline, watching = time.time() + 120, False
    while time.time() < deadline and not watching:
        callback.after_worker_group_poll_status(None)  # the controller's poll
        try:
            watching = ray.get(watcher.watching.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.5)
    assert watching, "the restarted watcher was never handed its worker group again"
    assert ray.get(watcher.__ray_call__.remote(lambda w: os.getpid()), timeout=60) != pid
    callback.before_worker_group_shutdown(group)
    ray.kill(worker)
