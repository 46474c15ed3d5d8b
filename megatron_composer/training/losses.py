"""Loss functions of the training step (wired in by `training.loss_plugins`).

Every loss returns a *sum* over tokens and the number of tokens it covers,
so the loop can normalize by the token count of the whole global batch
(exact under any split into micro-batches and data-parallel ranks).

The vocabulary-sized work (cross-entropy, MTP self-distillation) never
upcasts or copies whole logits L = [b, s, v], which stay in the model's dtype
(the one copy left is the CP teacher, 4):

1. Chunks of positions. `composer_forward` returns megatron's [s, b, v]
   storage as a [b, s, v] view; the losses walk it position-major, so a chunk
   is a contiguous block, upcast to fp32 on its own. fp32 temporaries are a
   few chunks (`chunk_rows`: CHUNK_ELEMENTS on CPU, cache-sized;
   CUDA_CHUNK_ELEMENTS on GPU, few kernel launches per sequence).
2. Cross-entropy (`ChunkedCrossEntropy`). Forward keeps one fp32 log-sum-exp
   per position; backward recomputes each chunk's softmax as exp(x - lse) and
   writes weight * upstream * (softmax - onehot(label)) in L's dtype (bf16
   grads for bf16 logits, as megatron's fused cross-entropy). With
   `overwrite_logits` it writes into L's own storage (the output layer's
   backward needs the gradient, not its output), else into one new L-sized
   buffer. Writing in backward is what lets the MTP teacher read the same
   main logits during the forward of the MTP loss. The function is per
   position and takes a temperature, CE(z_t / T): `cross_entropy_sum`
   weights and sums it; `token_log_probs` (the RL policy's log-probs at the
   sampling temperature) negates it and can return the entropy of
   softmax(z_t / T) from the same pass over the logits (no gradient).
   `fusion=True` (`--cross-entropy-loss-fusion`) takes the forward statistics
   from megatron-core's fused vocab-parallel cross-entropy
   (`fusions/fused_cross_entropy.py`), chunk by chunk. We do not call its
   autograd function: it keeps the whole fp32 softmax for backward (an
   L-sized fp32 tensor), casts its gradient to bf16 whatever the logits'
   dtype (fp32 training would lose precision), and subtracts the max in
   place, which on fp32 logits would overwrite the teacher. We hand its
   pieces an fp32 copy of one chunk and keep only the log-sum-exp. The
   pieces are `torch.compile`d (megatron's `jit_fuser`); on CPU we call the
   uncompiled functions (`_megatron_pieces`): inductor needs a C++
   toolchain there and compiles every new chunk shape (~15 s the first),
   more than the loss costs at CPU sizes. Same math either way. The flag is
   the loss plug-ins' (TrainingConfig), not TransformerConfig's
   `cross_entropy_loss_fusion`: GPTModel.forward never computes these losses.
3. Self-distillation KL (`ChunkedDistillation`) needs the teacher rows,
   which the cross-entropy's backward overwrites, so it computes its
   closed-form student gradient (q - p) * weight during the forward: into
   the student's own storage with `overwrite_logits`, else into a new
   buffer; backward only scales it by the upstream scalar. The per-chunk KL
   is the caller's (`kl_chunk`): the RL feedback KL (`rl.feedback_loss`)
   runs through the same loop.
4. The teacher under context parallelism: the zigzag `cp_shift_left` builds
   a shifted teacher, one L-sized copy in L's dtype that lives for the KL's
   forward (and briefly two more inside `cp_shift_left`: its concatenated
   pool and masked fill). With CP=1 the teacher rows are read in place.
5. Vocab-parallel: with `group`, each rank holds a contiguous 1/tp slice of
   the vocabulary (megatron's `VocabUtility` ranges); the per-position max
   and sum-exp (and the picked label logit) are all-reduced per chunk, each
   rank writes its slice of the gradient, and every rank returns the full sum.

Extra memory of loss + backward with `overwrite_logits`: a few fp32 chunks
and [s, b] statistics, for logits made by a layer as in the model (autograd
clones a gradient that shares a *leaf*'s storage into its `.grad`). Without
it: plus one L-sized gradient per loss. Measured on CPU at [4, 512, 4096]
(LM loss + self-distillation, forward + backward): the largest allocation
went from one logits-sized fp32 tensor (32 MiB) to one chunk (0.5 MiB), at
about the same speed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..parallel import shift_left

# shift(x, depth, fill): x[:, t + depth] at t within the sequence/document,
# `fill` past its end. `shift_left` for CP=1; under context parallelism the
# loop passes a zigzag-aware `parallel.cp_shift_left`, because the
# token `depth` ahead may live on another CP rank.
Shift = Callable[[torch.Tensor, int, object], torch.Tensor]

# Vocabulary elements per chunk of the fused losses. CPU: a chunk's fp32
# temporaries stay in cache. CUDA: 256 MiB per fp32 temporary, a few hundred
# positions of a 160K vocabulary, so the per-chunk launch cost stays small.
CHUNK_ELEMENTS = 1 << 17
CUDA_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(x: torch.Tensor) -> int:
    """Positions per chunk for position-major logits x [s, b, v]."""
    budget = CUDA_CHUNK_ELEMENTS if x.is_cuda else CHUNK_ELEMENTS
    return max(1, budget // max(1, x.shape[1] * x.shape[2]))


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice [start, start + v_local) of a vocabulary split over `group` (None: all of it)."""

    start: int = 0
    group: Optional[dist.ProcessGroup] = None

    @classmethod
    def of(cls, local_vocab: int, group: Optional[dist.ProcessGroup]) -> "VocabShard":
        if group is None or dist.get_world_size(group) == 1:
            return cls()
        return cls(dist.get_rank(group) * local_vocab, group)

    def all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, op=op, group=self.group)
        return t


def _local_labels(labels: torch.Tensor, shard: VocabShard, v: int):
    """(label index into this shard, 0 where outside it; whether the label is in this shard)."""
    local = labels - shard.start
    hit = (local >= 0) & (local < v)  # False for the ignored label -100
    return local.where(hit, 0), hit


# ---- per-chunk math: x [c, b, v_local] position-major chunks ------------------

def cross_entropy_statistics(x: torch.Tensor, labels: torch.Tensor, shard: VocabShard):
    """Per position: (lse - x[label], lse) with lse = log sum_v exp(x) over the whole vocabulary.

    x [c, b, v_local] any float dtype (not modified); labels [c, b] int64 global ids
    (-100 has no logit: its loss is just lse). Returns two [c, b] fp32 tensors.
    """
    x32 = x.float()
    m = shard.all_reduce(x32.amax(-1), dist.ReduceOp.MAX)
    local, hit = _local_labels(labels, shard, x.shape[-1])
    picked = x32.gather(-1, local.unsqueeze(-1)).squeeze(-1).where(hit, 0.0)
    sums = shard.all_reduce(torch.stack([picked, x32.sub(m.unsqueeze(-1)).exp_().sum(-1)]), dist.ReduceOp.SUM)
    lse = m + sums[1].log()
    return lse - sums[0], lse


def _megatron_pieces(compiled: bool):
    """megatron-core's fused cross-entropy pieces: the `jit_fuser` (torch.compile) versions, or
    the functions they wrap (same code, unfused) where compiling costs more than it saves."""
    from megatron.core.fusions import fused_cross_entropy as fused

    fns = (fused.calculate_logits_max, fused.calculate_predicted_logits, fused.calculate_cross_entropy_loss)
    return fns if compiled else tuple(getattr(f, "_torchdynamo_orig_callable", f) for f in fns)


def megatron_cross_entropy_statistics(x: torch.Tensor, labels: torch.Tensor, shard: VocabShard,
                                      compiled: Optional[bool] = None):
    """`cross_entropy_statistics` through megatron-core's fused vocab-parallel cross-entropy pieces.

    Same arguments and results. compiled: use the torch.compile'd pieces (default: on CUDA).
    """
    logits_max, predicted_logits, cross_entropy = _megatron_pieces(x.is_cuda if compiled is None else compiled)
    # megatron subtracts the max and exponentiates in place: give it a contiguous fp32 copy
    # of the chunk, never the logits (fp32 logits would be turned into the softmax).
    x32 = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
    x32, m = logits_max(x32)
    shard.all_reduce(m, dist.ReduceOp.MAX)
    v = x32.shape[-1]
    _, _, sums, exp_logits = predicted_logits(x32, labels.contiguous(), m, shard.start, shard.start + v)
    shard.all_reduce(sums, dist.ReduceOp.SUM)  # [predicted logit - max; sum exp], stacked on dim 0
    _, loss = cross_entropy(exp_logits, sums)
    return loss, m + sums[m.shape[0]:].log()


def cross_entropy_gradient(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                           shard: VocabShard, out: torch.Tensor) -> None:
    """out <- scale * (softmax(x) - onehot(label)), this shard's columns, in out's dtype.

    x, out [c, b, v_local] (out may be x itself); labels [c, b]; lse, scale [c, b] fp32.
    """
    g = x.float().sub(lse.unsqueeze(-1)).exp_()
    local, hit = _local_labels(labels, shard, x.shape[-1])
    g.scatter_add_(-1, local.unsqueeze(-1), -hit.to(g.dtype).unsqueeze(-1))
    out.copy_(g.mul_(scale.unsqueeze(-1)))


def log_softmax_over_shards(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """fp32 log-softmax over the last dim, whose entries may be split over `shard.group`."""
    x32 = x.float()
    if shard.group is None:
        return torch.log_softmax(x32, dim=-1)
    m = shard.all_reduce(x32.amax(-1, keepdim=True), dist.ReduceOp.MAX)
    shifted = x32 - m
    sum_exp = shard.all_reduce(shifted.exp().sum(-1, keepdim=True), dist.ReduceOp.SUM)
    return shifted.sub_(sum_exp.log_())


def scaled_chunk(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature: x itself at temperature 1 (the per-chunk math upcasts it), else a new fp32 chunk."""
    return x if temperature == 1.0 else x.float() / temperature


def softmax_entropy(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """H(softmax(x)) = -sum_v p_v log p_v per position over the whole vocabulary, fp32 [c, b].

    x [c, b, v_local] any float dtype (not modified). The same operations as
    -(exp(l) * l).sum(-1) with l = log_softmax(x.float()), row by row.
    """
    logp = log_softmax_over_shards(x, shard)
    return shard.all_reduce(-(logp.exp() * logp).sum(-1), dist.ReduceOp.SUM)


def distillation_kl_chunk(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor,
                          out: Optional[torch.Tensor], shard: VocabShard) -> torch.Tensor:
    """sum_t weight_t * KL(p_t || q_t) of one chunk (this shard's terms); out <- weight * (q - p).

    student, teacher [c, b, v_local] any float dtype; weight [c, b] fp32; out [c, b, v_local]
    (may be `student` itself: it is written last) or None. p = softmax(teacher),
    q = softmax(student). Returns an fp32 scalar, to be summed over the shards.
    """
    log_q = log_softmax_over_shards(student, shard)
    log_p = log_softmax_over_shards(teacher, shard)
    p = log_p.exp()
    total = (log_p.sub_(log_q).mul_(p).sum(-1) * weight).sum()
    if out is not None:
        out.copy_(log_q.exp_().sub_(p).mul_(weight.unsqueeze(-1)))
    return total


# ---- autograd: chunk loops over [b, s, v] logits --------------------------------

def _chunks(s: int, step: int):
    return ((p0, min(p0 + step, s)) for p0 in range(0, s, step))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per position CE(logits_t / temperature, label_t), and with `entropy` the entropy of
    softmax(logits_t / temperature) (no gradient); the gradient is computed in backward (module doc)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, fusion: bool, overwrite: bool, group, need_grad: bool,
                entropy: bool):
        x, labels = logits.transpose(0, 1), labels.transpose(0, 1)  # position-major, see module doc
        shard = VocabShard.of(x.shape[-1], group)
        statistics = megatron_cross_entropy_statistics if fusion else cross_entropy_statistics
        loss, lse = (torch.empty(x.shape[:2], dtype=torch.float32, device=x.device) for _ in range(2))
        h = torch.empty_like(lse) if entropy else None
        for p0, p1 in _chunks(x.shape[0], chunk_rows(x)):
            chunk = scaled_chunk(x[p0:p1], temperature)
            loss[p0:p1], lse[p0:p1] = statistics(chunk, labels[p0:p1], shard)
            if entropy:
                h[p0:p1] = softmax_entropy(chunk, shard)
        if need_grad:
            ctx.save_for_backward(logits, labels, lse)
            ctx.overwrite, ctx.shard, ctx.temperature = overwrite, shard, temperature
        if not entropy:
            return loss.transpose(0, 1)
        h = h.transpose(0, 1)
        ctx.mark_non_differentiable(h)
        return loss.transpose(0, 1), h

    @staticmethod
    def backward(ctx, grad_loss, *grad_entropy):
        logits, labels, lse = ctx.saved_tensors
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        x, g = logits.transpose(0, 1), grad.transpose(0, 1)
        scale = grad_loss.transpose(0, 1).float() / ctx.temperature  # d(z / T) / dz
        for p0, p1 in _chunks(x.shape[0], chunk_rows(x)):
            cross_entropy_gradient(scaled_chunk(x[p0:p1], ctx.temperature), labels[p0:p1], lse[p0:p1],
                                   scale[p0:p1], ctx.shard, g[p0:p1])
        return grad, None, None, None, None, None, None, None


class ChunkedDistillation(torch.autograd.Function):
    """A KL summed over the first `rows` student positions, whose student gradient `kl_chunk` computes
    chunk by chunk with its value during the forward; backward scales it (see module doc).

    kl_chunk(x, p0, p1, out) -> scalar: the chunk x = student positions [p0, p1)
    (position-major [c, b, v_local]) of sum_t weight_t * KL_t (this shard's terms), writing
    d(that sum) / dx into `out` (same shape, may be x itself: written last) unless out is None.
    Returns the sum over chunks (and shards), float32 (float64 for a float64 student).
    """

    @staticmethod
    def forward(ctx, student, kl_chunk: Callable, rows: int, overwrite: bool, group, need_grad: bool):
        x = student.transpose(0, 1)
        shard = VocabShard.of(x.shape[-1], group)
        grad = (student if overwrite else torch.empty_like(student)) if need_grad else None
        g = grad.transpose(0, 1) if need_grad else None
        total = torch.zeros((), dtype=torch.promote_types(student.dtype, torch.float32), device=x.device)
        for p0, p1 in _chunks(rows, chunk_rows(x)):
            total += kl_chunk(x[p0:p1], p0, p1, g[p0:p1] if need_grad else None)
        if need_grad:
            g[rows:].zero_()
        ctx.grad = grad
        return shard.all_reduce(total, dist.ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grad is None:
            raise RuntimeError("this chunked KL loss (self-distillation, feedback) was already differentiated "
                               "once; it keeps no graph to run backward again (retain_graph is not supported)")
        grad, ctx.grad = ctx.grad, None
        return grad.mul_(grad_total), None, None, None, None, None


def _needs_grad(logits: torch.Tensor) -> bool:
    return logits.requires_grad and torch.is_grad_enabled()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, *,
                      fusion: bool = False, overwrite_logits: bool = False,
                      group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """sum_t weight_t * (logsumexp(logits_t) - logits_t[label_t]), chunked (module doc, 2).

    Args:
        logits: [b, s, v_local] any float dtype and strides (megatron's [s, b, v] storage
            seen as [b, s, v] is read block by block).
        labels: [b, s] int64 vocabulary ids; -100 is ignored, as in F.cross_entropy.
        weight: [b, s] float.
        fusion: forward statistics through megatron-core's fused cross-entropy.
        overwrite_logits: backward writes the gradient into `logits`' storage (their values
            are gone afterwards); only for logits nothing else reads in backward. A second
            backward (retain_graph) then raises autograd's in-place modification error.
        group: process group the vocabulary is split over (None: logits hold all of it).
    Returns:
        fp32 scalar; its gradient flows to `logits` only.
    """
    weight = weight.float() * (labels != -100)
    per_position = ChunkedCrossEntropy.apply(logits, labels, 1.0, fusion, overwrite_logits, group,
                                             _needs_grad(logits), False)
    return (per_position * weight).sum()


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                    entropy: bool = False, overwrite_logits: bool = False,
                    group: Optional[dist.ProcessGroup] = None):
    """log softmax(logits_t / temperature)[label_t] per position, chunked as `cross_entropy_sum`.

    The same values as log_softmax(logits.float() / temperature).gather(-1, labels), without
    an fp32 [b, s, v] tensor in forward or backward: fp32 lives one chunk at a time, and
    backward writes weight * (onehot - softmax) / temperature in the logits' dtype.

    Args:
        logits: [b, s, v_local] any float dtype and strides.
        labels: [b, s] int64 vocabulary ids (every position has one).
        temperature: > 0.
        entropy: also return the entropy of softmax(logits_t / temperature) per position
            (fp32 [b, s], no gradient), computed in the same pass over the logits.
        overwrite_logits, group: as in `cross_entropy_sum`.
    Returns:
        log-probs [b, s] fp32 (differentiable in `logits`), or (log-probs, entropy).
    """
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"temperature {temperature!r} must be a finite number > 0 (the sampling temperature)")
    out = ChunkedCrossEntropy.apply(logits, labels, float(temperature), False, overwrite_logits, group,
                                    _needs_grad(logits), entropy)
    return (-out[0], out[1]) if entropy else -out


def distillation_sum(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, offset: int = 0, *,
                     overwrite_logits: bool = False, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """sum_t weight_t * KL(softmax(teacher_{t+offset}) || softmax(student_t)) over t < s - offset.

    Args:
        student: [b, s, v_local] any float dtype and strides.
        teacher: [b, s, v_local], read at position t + offset; gets no gradient.
        weight: [b, s] float.
        overwrite_logits: the student's gradient is written into its storage during this
            call (its values are gone afterwards); only for logits nothing else reads.
        group: as in `cross_entropy_sum`.
    Returns:
        fp32 scalar; its gradient flows to `student` only.
    """
    t, w = teacher.detach().transpose(0, 1), weight.transpose(0, 1).float()  # position-major, as the student
    shard = VocabShard.of(student.shape[-1], group)

    def kl_chunk(x, p0, p1, out):
        return distillation_kl_chunk(x, t[p0 + offset:p1 + offset], w[p0:p1], out, shard)

    rows = max(student.shape[1] - offset, 0)  # positions that have a teacher row
    return ChunkedDistillation.apply(student, kl_chunk, rows, overwrite_logits, group, _needs_grad(student))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, **kernel):
    """Next-token cross-entropy.

    Args:
        logits: [b, s, v] float, any dtype.
        labels: [b, s] int64 (the token each position predicts).
        loss_mask: [b, s] float, 1 where the token counts.
        **kernel: fusion, overwrite_logits, group (see `cross_entropy_sum`).
    Returns:
        (sum of masked losses: scalar, number of counted tokens: scalar).
    """
    mask = loss_mask.float()
    return cross_entropy_sum(logits, labels, mask, **kernel), mask.sum()


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
    **kernel,
):
    """MTP self-distillation: the MTP head at position t learns the main head's
    distribution for the same target token (the main head at t + depth), with
    the teacher detached. Per position: KL(teacher || student).

    Chunked (`distillation_sum`). With the CP=1 shift the teacher rows are read
    in place, main position t + depth for student position t; any other shift
    (the zigzag `cp_shift_left` under context parallelism, which brings the
    boundary tokens over from the neighbouring rank) builds the shifted
    teacher first: one logits-sized copy (module doc, 4).

    Args:
        mtp_logits: [b, s, v] student logits of MTP depth `depth`.
        main_logits: [b, s, v] main-head logits (teacher; gradient stopped here).
        loss_mask: [b, s] float, the main loss mask.
        depth: 1-based MTP depth.
        segment_ids: optional [b, s] document ids for packed samples.
        shift: see `Shift`.
        **kernel: overwrite_logits (the student's), group (see `distillation_sum`).
    Returns:
        (sum of per-position KL, number of positions).
    """
    valid = mtp_valid_mask(loss_mask, depth, segment_ids, shift)
    teacher, offset = main_logits.detach(), depth
    if shift is not shift_left:
        teacher, offset = shift(teacher, depth, 0.0), 0
    return distillation_sum(mtp_logits, teacher, valid, offset, **kernel), valid.sum()


def mtp_cross_entropy_loss(
    mtp_logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    depth: int,
    segment_ids: Optional[torch.Tensor] = None,
    shift: Shift = shift_left,
    **kernel,
):
    """DeepSeek-V3's MTP loss: cross-entropy on the token `depth` further ahead.
    **kernel as in `cross_entropy_sum`."""
    valid = mtp_valid_mask(loss_mask, depth, segment_ids, shift)
    shifted = shift(labels, depth, 0)
    return cross_entropy_sum(mtp_logits, shifted, valid, **kernel), valid.sum()
