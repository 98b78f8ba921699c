"""Pure PyTorch model code: no Ray, no torch.distributed."""

from rayllm.model.llama import KVCache, Llama, ModelArgs, flops_per_token, num_params

__all__ = ["KVCache", "Llama", "ModelArgs", "flops_per_token", "num_params"]
