"""train.activation_checkpointing: off, full or selective. Selective recomputes no matmul and no
attention in backward (full recomputes both), both give the plain run's loss and gradients, and
the planner counts selective between the two in memory and next to none in compute."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rayllm.config import TrainConfig
from rayllm.errors import ConfigError
from rayllm.model import Llama, ModelArgs
from rayllm.parallel.apply import wrap_blocks
from rayllm.parallel.layout import checkpoint_mode
from rayllm.parallel.planner import plan_memory

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=16)


class OpCounter(TorchDispatchMode):
    """How often each aten op runs inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward(mode: str) -> tuple[float, dict[str, torch.Tensor], dict[str, int]]:
    torch.manual_seed(0)
    model = Llama(ARGS)
    wrap_blocks(model, activation_checkpointing=mode, compile=False)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))  # (B, T + 1)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    with OpCounter() as counter:
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.item(), grads, counter.counts


def test_the_modes_and_a_bad_value():
    assert [checkpoint_mode(v) for v in (False, True, "full", "selective", "off")] == [
        "off",
        "full",
        "full",
        "selective",
        "off",
    ]
    with pytest.raises(ConfigError, match="must be false, true \\(full\\) or selective; got 'some'"):
        TrainConfig.from_dict({}, overrides=["train.activation_checkpointing=some"])


def test_selective_recomputes_no_matmul_and_no_attention_and_keeps_the_gradients():
    loss, grads, plain = _backward("off")
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    for mode in ("full", "selective"):
        mode_loss, mode_grads, counts = _backward(mode)
        assert mode_loss == loss
        for name, grad in grads.items():
            torch.testing.assert_close(mode_grads[name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")
        recomputed_mm = counts["mm"] - plain["mm"]
        if mode == "full":  # 6 of 7 matmuls per block again (not w2: backward needs nothing it
            # makes, and recomputing stops there) and attention's forward
            assert recomputed_mm == 6 * ARGS.n_layers and counts.get(attention) == ARGS.n_layers
        else:  # the norms and SiLU again, nothing else of weight
            assert recomputed_mm == 0 and attention not in counts
            assert counts["rsqrt"] == 2 * ARGS.n_layers and counts["silu"] == ARGS.n_layers


def test_the_planner_puts_selective_between_off_and_full():
    config = TrainConfig.from_yaml("configs/llama-8b.yaml")
    plans = {
        mode: plan_memory(config, gpu="h100-80gb", nodes=4, gpus_per_node=8, activation_checkpointing=mode)
        for mode in ("off", "full", "selective")
    }
    memory = {mode: p.breakdown["activations"] for mode, p in plans.items()}
    compute = {mode: p.seconds["compute"] for mode, p in plans.items()}
    assert memory["full"] < memory["selective"] < 0.7 * memory["off"]  # TP 2: 63% (TP 1: 52%, TP 8: 75%)
    assert compute["off"] < compute["selective"] < 1.05 * compute["off"] < compute["full"]
