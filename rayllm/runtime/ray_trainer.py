"""Ray Train's TorchTrainer with rayllm's two policies: which failures end a run, and which
worker counts an elastic run may take.

The controller is created inside ``_initialize_and_run_controller``: the one hook Ray Train
2.60 offers for its policies, so the subclass swaps them in there, and its preemption watcher
(runtime/preemption.py).
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

from rayllm.runtime.failure_policy import RayllmFailurePolicy
from rayllm.runtime.preemption import controller_callbacks, rays_own_watcher_off


class WholeLayoutsPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy, rounded down to a worker count the parallel layout and the
    global batch allow (``rayllm.parallel.layout.usable_world_sizes``): with TP 2 x FSDP 4 the
    world grows and shrinks by 8 ranks, never by one."""

    def __init__(self, scaling_config, usable: list[int]):
        super().__init__(scaling_config)
        self._usable = sorted(usable)

    def _count_possible_workers(self, reserved_resources) -> int:
        room = super()._count_possible_workers(reserved_resources)
        fitting = [n for n in self._usable if n <= room]
        return fitting[-1] if fitting else 0  # 0 < min_workers: Ray Train waits for room


class RayllmTorchTrainer(TorchTrainer):
    """TorchTrainer with RayllmFailurePolicy and, for elastic runs, WholeLayoutsPolicy."""

    def __init__(self, *args, usable_world_sizes: list[int] | None = None, control_name: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._usable_world_sizes = usable_world_sizes
        self._control_name = control_name

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        policy = RayllmFailurePolicy(self.run_config.failure_config, self._control_name)
        controller_init_kwargs["failure_policy"] = policy
        if self._usable_world_sizes is not None and self.scaling_config.elasticity_enabled:
            controller_init_kwargs["scaling_policy"] = WholeLayoutsPolicy(self.scaling_config, self._usable_world_sizes)
        # Ray Train's preemption watcher, built without actor handles as constructor arguments (preemption.py).
        added = controller_callbacks()
        controller_init_kwargs["callbacks"] = [*controller_init_kwargs.get("callbacks", []), *added]
        with rays_own_watcher_off(replaced=bool(added)):
            return super()._initialize_and_run_controller(**controller_init_kwargs)
