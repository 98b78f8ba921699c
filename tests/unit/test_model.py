"""The model: causal, shaped right, FLOPs formula agrees with PyTorch's own counter."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from rayllm.model import Llama, ModelArgs, flops_per_token

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=32)


def test_logits_shape_and_causality():
    torch.manual_seed(0)
    model = Llama(ARGS)
    tokens = torch.randint(0, 512, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 512)
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 512
    assert torch.allclose(model(changed)[:, :20], logits[:, :20], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 20:], logits[:, 20:])


def test_flops_per_token_matches_flop_counter():
    torch.manual_seed(0)
    model = Llama(ARGS)
    tokens = torch.randint(0, 512, (2, 32))
    counter = FlopCounterMode(display=False)
    # The math backend runs attention as matmuls the counter sees (the fused CPU kernel is not counted).
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(tokens).float().sum().backward()
    measured = counter.get_total_flops() / tokens.numel()
    assert abs(measured - flops_per_token(ARGS, 32)) / measured < 0.02
