"""Pure PyTorch model code: no Ray, no torch.distributed."""

from rayllm.model.llama import Llama, ModelArgs, flops_per_token, num_params

__all__ = ["Llama", "ModelArgs", "flops_per_token", "num_params"]
