"""Loss functions of the training step (wired in by `training.loss_plugins`).

Every loss returns a *sum* over tokens and the number of tokens it covers,
so the loop can normalize by the token count of the whole global batch
(exact under any split into micro-batches and data-parallel ranks).

The vocabulary-sized work (cross-entropy, MTP self-distillation) runs through
`fused_token_loss`: chunks of positions, each chunk's fp32 log-softmax and
closed-form gradient computed while it is in cache, the gradient written
into one logits-shaped buffer that backward only scales. Autograd through
F.cross_entropy / log_softmax would keep full-vocabulary fp32 copies per
loss and walk them again in backward. Chunks follow the position dim, so
megatron's [s, b, v] logits storage (which `composer_forward` returns
transposed) is read block by block and never copied.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

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
    mask = loss_mask.float()
    return fused_token_loss(logits, labels, mask, cross_entropy_chunk), mask.sum()


# Vocabulary elements per chunk of the fused losses: a chunk's fp32
# temporaries stay in cache, and the per-chunk Python cost stays small.
CHUNK_ELEMENTS = 1 << 17


def cross_entropy_chunk(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                        grad: Optional[torch.Tensor]) -> torch.Tensor:
    """Weighted cross-entropy of one chunk; writes its closed-form gradient into `grad`.

    logits [c, b, v] float (any leading dims); labels [c, b] int64 (-100 is ignored, as in
    F.cross_entropy); weight [c, b] float; grad [c, b, v] or None.
    Returns sum_t weight_t * (logsumexp(logits_t) - logits_t[label_t]);
    grad = weight_t * (softmax(logits_t) - onehot(label_t)).
    """
    logits = logits.float()
    log_p = torch.log_softmax(logits, dim=-1)
    weight = weight * (labels != -100)
    index = labels.clamp(min=0).unsqueeze(-1)
    total = -(log_p.gather(-1, index).squeeze(-1) * weight).sum()
    if grad is not None:
        grad.copy_(torch.softmax(logits, dim=-1))
        grad.scatter_add_(-1, index, torch.full(index.shape, -1.0, dtype=grad.dtype, device=grad.device))
        grad.mul_(weight.unsqueeze(-1))
    return total


def distillation_kl_chunk(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor,
                          grad: Optional[torch.Tensor]) -> torch.Tensor:
    """Weighted KL(teacher || student) of one chunk; writes the student gradient into `grad`.

    student, teacher [c, b, v] float, any leading dims (the teacher carries no gradient);
    weight [c, b] float; grad [c, b, v] or None. With p = softmax(teacher),
    q = softmax(student): returns sum_t weight_t * sum_v p_t (log p_t - log q_t);
    grad = weight_t * (q_t - p_t).
    """
    # torch's softmax kernel is faster than exp() of the log-softmax and as accurate
    student, teacher = student.float(), teacher.float()
    log_q = torch.log_softmax(student, dim=-1)
    log_p = torch.log_softmax(teacher, dim=-1)
    p = torch.softmax(teacher, dim=-1)
    if grad is not None:
        grad.copy_(torch.softmax(student, dim=-1)).sub_(p).mul_(weight.unsqueeze(-1))
    return (log_p.sub_(log_q).mul_(p).sum(-1) * weight).sum()


class FusedTokenLoss(torch.autograd.Function):
    """sum over positions of a per-position loss over the vocabulary, chunk by chunk.

    Every chunk's gradient is computed in the forward pass (closed form) and
    written into one buffer shaped like `logits`; backward scales it by the
    incoming scalar. So besides the inputs only that one full-vocabulary
    tensor is ever allocated, and nothing is saved for an autograd graph.
    """

    @staticmethod
    def forward(ctx, logits, target, weight, chunk_loss, offset: int, need_grad: bool):
        s = logits.shape[1]
        rows = s - offset  # positions that have a target row
        grad = torch.empty_like(logits) if need_grad else None
        if need_grad and rows < s:
            grad[:, max(rows, 0):].zero_()
        step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[0] * logits.shape[-1]))
        total = logits.new_zeros((), dtype=torch.float32)
        # Chunks are taken position-major ([s, b, ...] views): megatron's [s, b, v]
        # storage, which `composer_forward` returns as a [b, s, v] view, then gives
        # contiguous chunks, where [:, p0:p1] would be strided and every softmax
        # kernel would copy it first. The losses are per position: same sums.
        logits_p, target_p, weight_p = logits.transpose(0, 1), target.transpose(0, 1), weight.transpose(0, 1)
        grad_p = grad.transpose(0, 1) if need_grad else None
        for p0 in range(0, max(rows, 0), step):
            p1 = min(p0 + step, rows)
            total += chunk_loss(logits_p[p0:p1], target_p[p0 + offset:p1 + offset], weight_p[p0:p1],
                                grad_p[p0:p1] if need_grad else None)
        ctx.grad = grad
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grad is None:
            raise RuntimeError("the fused token loss was already differentiated once; it keeps no graph "
                               "to run backward again (retain_graph is not supported)")
        grad, ctx.grad = ctx.grad, None
        return grad.mul_(grad_total), None, None, None, None, None


def fused_token_loss(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, chunk_loss,
                     offset: int = 0) -> torch.Tensor:
    """sum_t chunk_loss(logits[:, t], target[:, t + offset], weight[:, t]) over positions t < s - offset.

    Args:
        logits: [b, s, v] float, any strides (chunks follow the position dim,
            so megatron's [s, b, v] storage is read block by block).
        target: [b, s, ...] labels or teacher logits, read at position t + offset.
        weight: [b, s] float; positions t >= s - offset have no target and add 0.
        chunk_loss: `cross_entropy_chunk` or `distillation_kl_chunk`.
    Returns:
        scalar fp32; its gradient flows to `logits` only.
    """
    need_grad = logits.requires_grad and torch.is_grad_enabled()
    return FusedTokenLoss.apply(logits, target, weight, chunk_loss, offset, need_grad)


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

    Fused and chunked (`fused_token_loss`): the teacher's log-softmax is taken
    without a graph and the student's gradient is (softmax(student) - p_teacher)
    * valid. With the CP=1 shift the teacher rows are read in place, main
    position t + depth for student position t; any other shift (the zigzag
    `cp_shift_left` under context parallelism, which brings the boundary
    tokens over from the neighbouring rank) builds the shifted teacher first.

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
    teacher, offset = main_logits.detach(), depth
    if shift is not shift_left:
        teacher, offset = shift(teacher, depth, 0.0), 0
    return fused_token_loss(mtp_logits, teacher, valid, distillation_kl_chunk, offset), valid.sum()


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
    return fused_token_loss(mtp_logits, shifted, valid, cross_entropy_chunk), valid.sum()
