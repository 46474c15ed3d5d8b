"""Loss plug-ins for the shared training loop.

Every loss returns a *sum* over tokens and the number of tokens it covers,
so the loop can normalize by the token count of the whole global batch
(exact under any split into micro-batches and data-parallel ranks).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..parallel import shift_left

# shift(x, depth, fill): x[:, t + depth] at t within the sequence/document,
# `fill` past its end. `shift_left` for CP=1; under context parallelism the
# loop passes a zigzag-aware `parallel.cp_shift_left`, because the
# token `depth` ahead may live on another CP rank.
Shift = Callable[[torch.Tensor, int, object], torch.Tensor]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor):
    """Next-token cross-entropy.

    Args:
        logits: [b, s, v] float.
        labels: [b, s] int64 (the token each position predicts).
        loss_mask: [b, s] float, 1 where the token counts.
    Returns:
        (sum of masked losses: scalar, number of counted tokens: scalar).
    """
    logits, (labels, loss_mask) = storage_order(logits, labels, loss_mask)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    mask = loss_mask.reshape(-1).float()
    return (per_token * mask).sum(), mask.sum()


def storage_order(logits: torch.Tensor, *per_token: torch.Tensor):
    """`logits` [b, s, v] and its [b, s] companions, viewed in the order the
    logits are stored in: megatron-core produces [s, b, v], and
    `composer_forward` returns its transpose, so flattening that view would
    copy the whole logits tensor. Sums over tokens do not depend on the order."""
    if logits.dim() == 3 and not logits.is_contiguous() and logits.transpose(0, 1).is_contiguous():
        return logits.transpose(0, 1), [t.transpose(0, 1) for t in per_token]
    return logits, list(per_token)


def mtp_valid_mask(
    loss_mask: torch.Tensor, depth: int, segment_ids: Optional[torch.Tensor] = None,
    shift: Shift = shift_left,
) -> torch.Tensor:
    """Where MTP depth `depth` (1-based) has a target: positions t with t+depth
    inside the sample, in the same document, and a counted label at t+depth.

    Args:
        loss_mask: [b, s] float.
        depth: k >= 1.
        segment_ids: [b, s] int document index per token, or None (one document).
        shift: see `Shift`.
    Returns:
        [b, s] float.
    """
    valid = shift(loss_mask.float(), depth, 0.0)
    if segment_ids is not None:
        valid = valid * (shift(segment_ids, depth, -1) == segment_ids).float()
    return valid


def mtp_self_distillation_loss(
    mtp_logits: torch.Tensor,
    main_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    depth: int,
    segment_ids: Optional[torch.Tensor] = None,
    shift: Shift = shift_left,
):
    """MTP self-distillation: the MTP head at position t learns the main head's
    distribution for the same target token (the main head at t + depth), with
    the teacher detached. Per position: KL(teacher || student).

    Args:
        mtp_logits: [b, s, v] student logits of MTP depth `depth`.
        main_logits: [b, s, v] main-head logits (teacher; gradient stopped here).
        loss_mask: [b, s] float, the main loss mask.
        depth: 1-based MTP depth.
        segment_ids: optional [b, s] document ids for packed samples.
        shift: see `Shift`.
    Returns:
        (sum of per-position KL, number of positions).
    """
    valid = mtp_valid_mask(loss_mask, depth, segment_ids, shift)
    teacher = shift(main_logits.detach().float(), depth, 0.0)
    log_t = F.log_softmax(teacher, dim=-1)
    log_s = F.log_softmax(mtp_logits.float(), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return (kl * valid).sum(), valid.sum()


def mtp_cross_entropy_loss(
    mtp_logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    depth: int,
    segment_ids: Optional[torch.Tensor] = None,
    shift: Shift = shift_left,
):
    """DeepSeek-V3's MTP loss: cross-entropy on the token `depth` further ahead."""
    valid = mtp_valid_mask(loss_mask, depth, segment_ids, shift)
    shifted = shift(labels, depth, 0)
    mtp_logits, (shifted, valid) = storage_order(mtp_logits, shifted, valid)
    per_token = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]).float(), shifted.reshape(-1),
                                reduction="none")
    return (per_token * valid.reshape(-1)).sum(), valid.sum()
