"""A run's config tree: its sections (sections.py) and the storage section, checked as one.

A YAML file gives the tree, dotted overrides (``train.max_steps=50``) patch it, and
validation rejects unknown keys (naming the nearest valid key) and wrong types before
any worker starts. The resolved tree is what a run records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rayllm.config.base import RootConfig
from rayllm.config.checks import (
    RANGES,
    check_cluster,
    check_data,
    check_model,
    check_names,
    check_parallel,
    check_ranges,
    check_storage,
    check_tracking,
    check_train,
)
from rayllm.config.sections import (
    ClusterSettings,
    DataSettings,
    ModelSettings,
    ParallelSettings,
    RunSettings,
    TrackingSettings,
    TrainingSettings,
)
from rayllm.io.settings import StorageSettings


@dataclass(repr=False)  # RootConfig.__repr__: redacted
class TrainConfig(RootConfig):
    """The whole run."""

    run: RunSettings = field(default_factory=RunSettings)
    data: DataSettings = field(default_factory=DataSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    train: TrainingSettings = field(default_factory=TrainingSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    # Object storage for every s3:// path of the run: data, checkpoints, metrics, Aim.
    storage: StorageSettings = field(default_factory=StorageSettings)

    MOVED_KEYS: ClassVar[dict[str, str]] = {"data.storage": "storage"}

    @property
    def worker_range(self) -> tuple[int, int]:
        n = self.cluster.num_workers
        return (n, n) if isinstance(n, int) else (n[0], n[1])

    def validate(self) -> None:
        """Every key against its range, then the checks that span keys; reads no file but the YAML.

        With ``model.init_from`` the model shape comes from the folder (rayllm.config.resolve, on the
        driver), so the YAML's shape keys are not checked here: resolve checks the shape it sets.
        """
        check_ranges(self, [k for k in RANGES if not k.startswith("model.")])
        check_names(self.run)
        check_data(self.data)
        check_storage(self.storage)
        check_model(self.model, shape=not self.model.init_from)
        check_train(self.train, self.cluster)
        check_cluster(self.cluster)
        check_parallel(
            self.parallel, self.train, self.model, self.data.seq_len, self.worker_range, self.cluster.use_gpu
        )
        check_tracking(self.tracking)
