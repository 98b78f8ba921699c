"""Greedy continuations of fixed prompts during training: what the model has learned, in words.

Every rank runs the same forwards (under FSDP each forward is a collective), always for the
same number of tokens, so no rank stops early; text after an end-of-text token is cut
afterwards. The window slides when a continuation outgrows the model's context.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_continuations(
    model: nn.Module, prompts: list[list[int]], new_tokens: int, max_len: int, device: torch.device
) -> list[list[int]]:
    """The ``new_tokens`` most likely next ids after each prompt (token ids in, token ids out)."""
    was_training = model.training
    model.eval()
    outputs = []
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt or [0]], dtype=torch.long, device=device)
            for _ in range(new_tokens):
                logits = model(ids[:, -max_len:])
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            outputs.append(ids[0, len(prompt or [0]) :].tolist())
    finally:
        model.train(was_training)
    return outputs
