"""Float8 training of the blocks' matmuls through torchao (``train.float8``), on GPUs that have
float8 tensor cores (compute capability 8.9 or newer: H100, H200, L40S).

torchao's recipe as torchtitan uses it: dynamic tensorwise scaling, every ``nn.Linear`` inside a
block swapped for ``Float8Linear`` (the embedding and the output head stay in bf16: the head's
logits feed the loss, and float8 gains little there), FSDP all-gathers its weights in float8,
and under TP the block's inputs are cast to float8 before their all-gather. Parameters and the
optimizer stay fp32, so checkpoints load with or without float8.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from rayllm.errors import ConfigError

FLOAT8_CAPABILITY = (8, 9)  # Ada and Hopper: float8 tensor cores


def check_float8(device: torch.device) -> None:
    """Refuse ``train.float8`` in one line where it cannot run: no torchao, or a GPU without float8
    matmuls. (A CPU run is refused by the config's checks before any worker starts; called
    directly on CPU, float8 is emulated.)"""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("train.float8 needs torchao: pip install 'rayllm[float8]', or set train.float8: false")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FLOAT8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.float8 needs float8 matmuls (compute capability 8.9 or newer: H100, H200, L40S); {name} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; set train.float8: false"
        )


def convert_blocks(model: nn.Module, *, all_gather_float8: bool, emulate: bool = False) -> None:
    """Every Linear inside a block becomes torchao's Float8Linear, in place (before TP and FSDP).
    ``all_gather_float8``: FSDP gathers those weights in float8 (half the bytes of bf16).
    ``emulate``: float8 rounding with higher-precision matmuls, for checks on CPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather_float8, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _module, fqn: fqn.startswith("layers."))


def precompute_scales_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """With float8 all-gathers, each weight's scale is computed once per optimizer step for all
    shards together (one all-reduce of the amaxes), not by every unit at every gather."""
    if not any(m.config.enable_fsdp_float8_all_gather for m in float8_linears(model)):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def float8_linears(model: nn.Module) -> list[nn.Module]:
    """The model's Float8Linear modules (none unless ``convert_blocks`` ran)."""
    return [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
