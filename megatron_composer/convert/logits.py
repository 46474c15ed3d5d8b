"""Logits of a megatron-composer checkpoint for one token sequence.

The reference side of a logit-parity check: build and load the model with
`models.load_checkpoint_model` (the same path training resumes through) and
run `composer_forward` in fp32.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch

from ..models import composer_forward, load_checkpoint_model
from ..parallel.layout import ParallelLayout


def checkpoint_logits(
    load_dir: str,
    tokens: Union[Sequence[int], torch.Tensor],
    include_mtp: bool = False,
    layout: Optional[ParallelLayout] = None,
) -> torch.Tensor:
    """fp32 logits of a checkpoint for one sequence.

    Args:
        load_dir: checkpoint root (latest iteration) or an iter_XXXXXXX dir.
        tokens: [s] token ids.
        include_mtp: also return the MTP heads.
    Returns:
        [s, vocab] float32, or [1 + mtp_layers, s, vocab] with `include_mtp`
        (head k at position t predicts token t + k + 1; MTP rows at the last
        k + 1 positions see padding and are meaningless).
    """
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)
    if not os.path.exists(load_dir):
        raise FileNotFoundError(f"no checkpoint at {load_dir}")
    model, cfg = load_checkpoint_model(load_dir, ids.shape[1], layout)
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < cfg.vocab_size:
        raise ValueError(f"token ids must be in [0, vocab_size={cfg.vocab_size}); got "
                         f"min {int(ids.min())}, max {int(ids.max())}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    with torch.no_grad():
        logits, mtp = composer_forward(model, ids, positions)
    if not include_mtp:
        return logits[0].float().cpu()
    return torch.stack([logits[0]] + [m[0] for m in mtp]).float().cpu()
