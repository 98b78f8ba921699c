"""rayllm: an elastic, fault-tolerant LLM trainer on Ray.

import rayllm
result = rayllm.train(rayllm.TrainConfig.from_yaml("configs/tiny.yaml", overrides=["train.max_steps=50"]))
model = rayllm.load(result.checkpoint)            # or a run dir, or a Hugging Face Llama folder
print(model.generate("def ", 32))
rayllm.export_hf(result.checkpoint, "hf/tiny")    # transformers.LlamaForCausalLM.from_pretrained("hf/tiny")
rayllm.evaluate(result.checkpoint, "data/demo/val", workers=2).perplexity
"""

from rayllm.config import TrainConfig
from rayllm.errors import CheckpointError, ConfigError, DataError, RayllmError

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "RayllmError",
    "TrainConfig",
    "TrainResult",
    "evaluate",
    "export_hf",
    "load",
    "train",
]


def train(config: TrainConfig, *, quiet: bool = False):
    """Train as ``config`` says; returns a TrainResult (final metrics, latest checkpoint)."""
    from rayllm.runtime.launch import train as _train

    return _train(config, quiet=quiet)


def load(path: str, *, device: str = "auto", storage=None, tokenizer: str | None = None):
    """A trained model with its tokenizer (``Pretrained``): from a checkpoint at any world size, a run
    dir's latest checkpoint (local or s3://), or a local Hugging Face Llama folder."""
    from rayllm.use.pretrained import load as _load

    return _load(path, device=device, storage=storage, tokenizer=tokenizer)


def evaluate(checkpoint: str, data, *, workers: int = 2, seq_len: int | None = None, **kwargs):
    """Perplexity of a checkpoint over held-out shards, on ``workers`` Ray actors (an EvalResult)."""
    from rayllm.use.evaluate import evaluate as _evaluate

    return _evaluate(checkpoint, data, workers=workers, seq_len=seq_len, **kwargs)


def export_hf(checkpoint: str, out_dir: str, *, storage=None, tokenizer: str | None = None) -> str:
    """A checkpoint as a Hugging Face Llama folder (config.json, model.safetensors, tokenizer files)."""
    from rayllm.use.pretrained import export_checkpoint

    return export_checkpoint(checkpoint, out_dir, storage=storage, tokenizer=tokenizer)


def __getattr__(name):
    if name == "TrainResult":
        from rayllm.runtime.launch import TrainResult

        return TrainResult
    raise AttributeError(name)
