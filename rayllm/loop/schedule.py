"""Linear warmup then cosine decay, a pure function of the step (so resume needs only the step)."""

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if max_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    min_lr = lr * min_lr_ratio
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
