"""Logits of a megatron-composer checkpoint for one token sequence.

The reference side of a logit-parity check: build the model the checkpoint's
meta.json describes, load it with `checkpoint.load_checkpoint`
(the same path training resumes through) and run `composer_forward` in fp32.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch

from ..models import build_model, composer_forward
from ..parallel.layout import ParallelLayout, initialize_parallel
from ..platform import init_distributed
from ..checkpoint import load_checkpoint
from .config import model_config_from_dict
from .hf import locate_checkpoint


def load_checkpoint_model(load_dir: str, seq_length: int, layout: Optional[ParallelLayout] = None,
                          iteration: Optional[int] = None):
    """(GPTModel in eval mode, ModelConfig) of a checkpoint, fp32, on this process.

    Initializes torch.distributed (a single process if not launched) and
    megatron-core's parallel state for `layout` (default: every rank a data-parallel replica).
    """
    root, it_dir, meta = locate_checkpoint(load_dir, iteration)
    cfg = model_config_from_dict(meta["model_config"])
    env = init_distributed()
    layout = layout or ParallelLayout(world_size=env.world_size)
    initialize_parallel(layout, seed=0)
    model = build_model(cfg, layout, torch.float32, seq_length=seq_length)
    load_checkpoint(root, model, iteration=int(meta.get("iteration", 0)))
    model.eval()
    return model, cfg


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
