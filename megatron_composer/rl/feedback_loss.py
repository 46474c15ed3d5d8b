"""The textual-feedback loss: on-policy self-distillation from hinted contexts (`rl.feedback`).

For each hinted target message of a step, the teacher is the policy without
gradient on the context with the hint inserted, the student the policy on
the original context; both predict the message's own tokens (the sampled
ones), aligned by position in the message (`feedback.teacher_context`). Per
predicting position t, with p_T and p_S the teacher's and student's
next-token distributions:

    forward   KL(p_T || p_S) = sum_v p_T(v) (log p_T(v) - log p_S(v))
    reverse   KL(p_S || p_T) = sum_v p_S(v) (log p_S(v) - log p_T(v))      (the default)

and the loss is feedback_coef * (sum of KL over every target position of the
step) / (their number): a plug-in beside the policy loss whose count is the
target positions of its micro-batch, so the trainer's one global count makes
it exact under any micro-batch and data-parallel split.

Reverse is the default because the tokens are the student's own samples, as
in on-policy distillation: it is mode-seeking, so the student drops what the
hinted teacher rejects (the unknown tool's name) instead of spreading mass
over everything the teacher finds plausible.

Top-k (`--feedback-kl-topk K`, for large vocabularies): the teacher keeps its
K most likely tokens and one bucket for the rest of its mass, and both
distributions are compared over those K + 1 outcomes (the student's bucket
is its mass outside the K tokens). That is a true KL of the coarsened
distributions (>= 0, zero iff they agree on the buckets), a lower bound of
the full KL, and the full KL when the rest of the mass is nothing.

Teacher log-probs are computed before the step (`FeedbackTeacher.annotate`)
and travel with the packed micro-batch: `feedback_rows` [1, T] (-1: not a
target position, else a row of `feedback_table`), and the table holds only
the target positions' rows.

The loss never holds the student's fp32 log-probs of all target positions at
once: `feedback_kl_sum` runs `feedback_kl` on chunks of target positions with
autograd inside each chunk and keeps only the gradient, in the logits' dtype,
written over the gathered student rows (`training.losses.ChunkedDistillation`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..parallel.wrappers import unwrap
from ..training.batches import Batch
from ..training.losses import ChunkedDistillation
from .feedback import teacher_context
from .packing import pack_micro_batches

KL_DIRECTIONS = ("forward", "reverse")
TEACHERS = ("current", "lagged")


def feedback_kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor,
                teacher_index: Optional[torch.Tensor] = None, direction: str = "reverse") -> torch.Tensor:
    """Per-position KL between teacher and student next-token distributions (module docstring).

    student_logits: [N, V] (float32 or float64; lower precisions are upcast to float32).
    teacher_logp: [N, V] log-probs (full), or [N, K + 1] with `teacher_index`: log-probs of the
        teacher's top K tokens and, last, of the rest of its mass.
    teacher_index: None (full vocabulary), or [N, K] int64 token ids of the top K.
    Returns [N] KL values, differentiable in `student_logits`.
    """
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"--feedback-kl {direction!r}; use one of {', '.join(KL_DIRECTIONS)}")
    z = student_logits if student_logits.dtype == torch.float64 else student_logits.float()
    teacher_logp = teacher_logp.to(z.dtype)
    log_s = torch.log_softmax(z, dim=-1)
    if teacher_index is not None:
        rest = z.scatter(-1, teacher_index, float("-inf")).logsumexp(-1) - z.logsumexp(-1)
        log_s = torch.cat([log_s.gather(-1, teacher_index), rest[:, None]], dim=-1)
    if direction == "forward":
        p_t = teacher_logp.exp()
        terms = torch.where(p_t > 0, p_t * (teacher_logp - log_s), torch.zeros_like(log_s))
    else:
        p_s = log_s.exp()
        terms = torch.where(p_s > 0, p_s * (log_s - teacher_logp), torch.zeros_like(log_s))
    return terms.sum(-1)


def feedback_kl_sum(student_logits: torch.Tensor, teacher_logp: torch.Tensor,
                    teacher_index: Optional[torch.Tensor] = None, direction: str = "reverse", *,
                    rows: Optional[torch.Tensor] = None, overwrite_logits: bool = False) -> torch.Tensor:
    """sum over the student rows of `feedback_kl`, chunked over rows (`training.losses.chunk_rows`).

    Each chunk's KL and its gradient are computed together in the forward (autograd on the
    chunk, the same operations as `feedback_kl` on all rows); only the gradient is kept, in
    student_logits' dtype. fp32 temporaries are a few chunks, never [N, V].

    student_logits: [N, V] any float dtype.
    teacher_logp, teacher_index: the teacher's table, as in `feedback_kl` ([M, V] or [M, K + 1],
        and [M, K] or None).
    rows: [N] int64, the table row of each student row (None: row i of the table, M = N).
    overwrite_logits: the gradient is written over `student_logits` during this call (their
        values are gone afterwards); for a copy nothing else reads, such as gathered rows.
    Returns a float32 scalar (float64 for float64 logits), differentiable in `student_logits`.
    """
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"--feedback-kl {direction!r}; use one of {', '.join(KL_DIRECTIONS)}")
    n = student_logits.shape[0]
    table = torch.arange(n, device=teacher_logp.device) if rows is None else rows.to(teacher_logp.device)

    def kl_chunk(x, p0, p1, out):  # x, out [c, 1, V]: rows p0..p1, position-major
        picked = table[p0:p1]
        teacher = (teacher_logp[picked], None if teacher_index is None else teacher_index[picked])
        z = x[:, 0].detach()
        if out is None:
            return feedback_kl(z, *teacher, direction).sum()
        with torch.enable_grad():
            total = feedback_kl(z.requires_grad_(), *teacher, direction).sum()
            grad, = torch.autograd.grad(total, z)
        out[:, 0].copy_(grad)
        return total.detach()

    need_grad = student_logits.requires_grad and torch.is_grad_enabled()
    return ChunkedDistillation.apply(student_logits[None], kl_chunk, n, overwrite_logits, None, need_grad)


def teacher_rows(logits: torch.Tensor, topk: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A teacher's table rows from its logits [N, V]: (log-probs [N, V], None) or, with topk K < V,
    (log-probs of its top K and of the rest [N, K + 1], token ids [N, K])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if not topk or topk >= logp.shape[-1]:
        return logp, None
    top, index = logp.topk(topk, dim=-1)
    rest = logits.float().scatter(-1, index, float("-inf")).logsumexp(-1) - logits.float().logsumexp(-1)
    return torch.cat([top, rest[:, None]], dim=-1), index


@dataclass
class FeedbackTable:
    """The teacher's rows of one micro-batch's target positions (see `teacher_rows`)."""

    logp: torch.Tensor  # [N, V] or [N, K + 1] float32
    index: Optional[torch.Tensor] = None  # [N, K] int64 (top-k only)

    def to(self, device, non_blocking: bool = True) -> "FeedbackTable":
        return FeedbackTable(self.logp.to(device, non_blocking=non_blocking),
                             None if self.index is None else self.index.to(device, non_blocking=non_blocking))


class TeacherWeights:
    """The teacher's forward (`--feedback-teacher`): the policy's current weights, or a frozen copy
    refreshed from them every `lag` steps (and when first used, e.g. after a resume).

    Callable on a packed `Batch`: logits [1, S, V] float32, no gradient. `before_forward` runs
    before a forward of the current weights (the trainer clears router replay there, so the
    teacher's routers route its own context).
    """

    def __init__(self, model, kind: str, lag: int, build_copy: Callable, device, before_forward=None):
        if kind not in TEACHERS:
            raise ValueError(f"--feedback-teacher {kind!r}; use one of {', '.join(TEACHERS)}")
        self.model, self.kind, self.lag, self.build_copy = model, kind, lag, build_copy
        self.device, self.before_forward, self.copy = device, before_forward, None

    def refresh(self, iteration: int) -> None:
        """Before the step that follows `iteration` steps: the lagged copy catches up every `lag` steps."""
        if self.kind != "lagged" or (self.copy is not None and iteration % self.lag):
            return
        if self.copy is None:
            self.copy = self.build_copy().to(self.device).eval()
            for p in self.copy.parameters():
                p.requires_grad_(False)
        self.copy.load_state_dict(unwrap(self.model).state_dict())

    def __call__(self, batch) -> torch.Tensor:
        from ..models import composer_forward

        model = self.copy if self.kind == "lagged" else self.model
        if model is self.model and self.before_forward is not None:
            self.before_forward()
        device_batch = batch.to(self.device)
        module = unwrap(model)
        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                logits, _ = composer_forward(module, device_batch.tokens, device_batch.position_ids,
                                             device_batch.packed_seq_params)
        finally:
            module.train(training)
        return logits.float()


class FeedbackTeacher:
    """Computes the teacher rows of a micro-batch's hinted messages.

    Args:
        logits_fn: a packed `training.batches.Batch` [1, S] -> logits [1, S, V], the teacher's
            forward (called under no_grad).
        topk: 0 for the full vocabulary, else K.
        token_budget: teacher contexts are packed into forwards of at most this many tokens.
    """

    def __init__(self, logits_fn: Callable, topk: int = 0, token_budget: int = 4096):
        self.logits_fn, self.topk, self.token_budget = logits_fn, topk, token_budget

    def annotate(self, batch, samples) -> object:
        """`batch` (the unsplit packing of `samples`, in order) with `feedback_rows` and `feedback_table`."""
        from ..parallel.zigzag_batch import packed_seq_params_for

        jobs, offset = [], 0  # (teacher ids, teacher first position, student first position, length)
        for s in samples:
            for hint in s.hints:
                ids, first = teacher_context(s, hint)
                jobs.append((ids, first, offset + len(s.prompt_ids) + hint.start - 1, hint.end - hint.start))
            offset += s.length
        rows = torch.full(batch.tokens.shape, -1, dtype=torch.long)
        if not jobs:
            return dataclasses.replace(batch, feedback_rows=rows, feedback_table=None)
        parts: dict[int, tuple] = {}
        for pack in pack_micro_batches([len(j[0]) for j in jobs], max(self.token_budget, max(len(j[0]) for j in jobs))):
            ids = [torch.tensor(jobs[j][0]) for j in pack]
            tokens = torch.cat(ids)[None]
            teacher_batch = Batch(tokens=tokens, labels=tokens, loss_mask=torch.ones(tokens.shape),
                                  position_ids=torch.cat([torch.arange(len(x)) for x in ids])[None],
                                  segment_ids=torch.cat([torch.full((len(x),), k) for k, x in enumerate(ids)])[None],
                                  packed_seq_params=packed_seq_params_for([len(x) for x in ids]))
            with torch.no_grad():
                logits = self.logits_fn(teacher_batch)[0]
            at = 0
            for j, x in zip(pack, ids):
                _, first, _, n = jobs[j]
                parts[j] = teacher_rows(logits[at + first:at + first + n].detach().cpu(), self.topk)
                at += len(x)
        logp, index, next_row = [], [], 0
        for j, (_, _, student_first, n) in enumerate(jobs):
            rows[0, student_first:student_first + n] = torch.arange(next_row, next_row + n)
            next_row += n
            logp.append(parts[j][0])
            index.append(parts[j][1])
        table = FeedbackTable(torch.cat(logp), None if index[0] is None else torch.cat(index))
        return dataclasses.replace(batch, feedback_rows=rows, feedback_table=table)


@dataclass
class FeedbackLoss:
    """The loss plug-in: sum of `feedback_kl` over a micro-batch's target positions; count: their number."""

    direction: str = "reverse"
    scale: float = 1.0  # --feedback-coef
    name: str = "feedback kl"
    stats: dict = field(default_factory=dict)

    def count(self, batch, shift):
        rows = getattr(batch, "feedback_rows", None)
        n = 0.0 if rows is None else float((rows >= 0).sum())
        return torch.tensor(n, device=batch.tokens.device)

    def loss_sum(self, batch, out, shift):
        rows = getattr(batch, "feedback_rows", None)
        if rows is None or batch.feedback_table is None:
            return torch.zeros((), device=batch.tokens.device)
        at = (rows[0] >= 0).nonzero().squeeze(1)
        table = batch.feedback_table
        # out.logits[0, at] is a copy of the target rows that only this loss reads: its gradient goes there
        return feedback_kl_sum(out.logits[0, at], table.logp, table.index, self.direction, rows=rows[0, at],
                               overwrite_logits=True)
