"""The run's configuration: typed sections with one set of defaults (sections.py), the YAML and
dotted-override builder (tree.py), every key's range (checks.py), and the driver's one look
at the folders a config names (resolve.py, imported on its own: it reads storage)."""

from rayllm.config.base import RootConfig
from rayllm.config.checks import HF_SHAPE_KEYS, RANGES, check_batch_split, check_range
from rayllm.config.sections import (
    ClusterSettings,
    DataSettings,
    ModelSettings,
    ParallelSettings,
    RunSettings,
    SourceSettings,
    TrackingSettings,
    TrainingSettings,
)
from rayllm.config.train import TrainConfig
from rayllm.config.tree import build_config, read_yaml_mapping

__all__ = [
    "HF_SHAPE_KEYS",
    "RANGES",
    "RootConfig",
    "ClusterSettings",
    "DataSettings",
    "ModelSettings",
    "ParallelSettings",
    "RunSettings",
    "SourceSettings",
    "TrackingSettings",
    "TrainConfig",
    "TrainingSettings",
    "build_config",
    "check_batch_split",
    "check_range",
    "read_yaml_mapping",
]
