"""Pure PyTorch model code: no Ray, no torch.distributed. shape.py is plain Python (the config
imports it); the rest imports torch, so it is loaded on first use."""

from rayllm.model.shape import ModelArgs, ModelShape

_LLAMA = ("KVCache", "Llama", "flops_per_token", "num_params")
__all__ = ["ModelArgs", "ModelShape", *_LLAMA]


def __getattr__(name: str):
    if name in _LLAMA:
        from rayllm.model import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'rayllm.model' has no attribute {name!r}")
