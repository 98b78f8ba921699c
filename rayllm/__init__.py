"""rayllm: an elastic, fault-tolerant LLM trainer on Ray.

from rayllm import TrainConfig, train
result = train(TrainConfig.from_yaml("configs/tiny.yaml", overrides=["train.max_steps=50"]))
"""

from rayllm.config import TrainConfig
from rayllm.errors import ConfigError, DataError, RayllmError

__version__ = "0.1.0"
__all__ = ["ConfigError", "DataError", "RayllmError", "TrainConfig", "TrainResult", "train"]


def train(config: TrainConfig, *, quiet: bool = False):
    """Train as ``config`` says; returns a TrainResult (final metrics, latest checkpoint)."""
    from rayllm.trainer.launch import train as _train

    return _train(config, quiet=quiet)


def __getattr__(name):
    if name == "TrainResult":
        from rayllm.trainer.launch import TrainResult

        return TrainResult
    raise AttributeError(name)
