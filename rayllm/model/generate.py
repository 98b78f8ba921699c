"""Decoding with a KV cache: greedy, or sampled with temperature, top-k and top-p.

Pure PyTorch on one device (no torch.distributed): a trained model is loaded whole, whatever
the world size it was trained with (see ``rayllm.use.pretrained``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayllm.model.llama import KVCache, Llama


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (top_k and top_p then do nothing); top_k 0 and top_p 1 keep every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy); got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps every token); got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token); got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, vocab) -> the next id per row (B, 1)."""
    if sampling.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (nucleus).
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= sampling.top_p  # mass before this one
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model: Llama,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """The ids that follow ``prompt`` (without it): at most ``max_new_tokens``, ending early after a stop id.

    One forward over the prompt fills the cache, then one position per token. When the context
    reaches the model's max_seq_len the window slides: the cache is refilled from the last half
    of the context, so long generations keep going at the cost of one prefill per half window.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    max_len = model.args.max_seq_len
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(sampling.seed)
    context = list(prompt) or [stop_ids[0] if stop_ids else 0]
    window = context[-max_len:]
    # Sized to what this call can use, not to max_seq_len (a 128k context's cache is gigabytes).
    capacity = min(max_len, len(window) + max_new_tokens)
    cache = KVCache(model.args, 1, device, dtype, max_len=capacity)
    out: list[int] = []
    try:
        logits = model(torch.tensor([window], device=device), cache=cache)[:, -1]
        for _ in range(max_new_tokens):
            token = int(next_token(logits, sampling, generator))
            out.append(token)
            context.append(token)
            if token in stop_ids or len(out) == max_new_tokens:
                break
            if cache.length >= capacity:  # only at max_len: slide, refilling from the last half of the context
                cache.reset()
                logits = model(torch.tensor([context[-(max_len // 2) :]], device=device), cache=cache)[:, -1]
            else:
                logits = model(torch.tensor([[token]], device=device), cache=cache)[:, -1]
    finally:
        model.train(was_training)
    return out
