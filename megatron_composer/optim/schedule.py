"""Learning-rate schedule (Megatron's warmup + cosine/linear decay to min-lr)."""
from __future__ import annotations

import math


def learning_rate(
    iteration: int,
    lr: float,
    min_lr: float,
    warmup_iters: int,
    decay_iters: int,
    style: str = "cosine",
) -> float:
    """LR for the update made at 0-based `iteration`.

    Linear warmup from lr/warmup to lr over `warmup_iters` updates, then decay
    from lr to `min_lr` at `decay_iters` ("cosine", "linear") or hold
    ("constant"); `min_lr` after `decay_iters`.
    """
    step = iteration + 1
    if warmup_iters > 0 and step <= warmup_iters:
        return lr * step / warmup_iters
    if style == "constant":
        return lr
    if step >= decay_iters:
        return min_lr
    span = max(decay_iters - warmup_iters, 1)
    progress = (step - warmup_iters) / span
    if style == "linear":
        coeff = 1.0 - progress
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {style!r}; use cosine, linear or constant")
    return min_lr + coeff * (lr - min_lr)
