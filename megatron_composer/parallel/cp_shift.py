"""Left shifts of labels and masks within each document, for CP=1 and for zigzag CP.

`shift_left` is the plain shift; `cp_shift_left` gives the same result on a
rank-local zigzag tensor, fetching the few tokens that live on other CP
ranks with one small all-gather. `shift_plan` is its pure index math.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import all_gather_single
from .zigzag import ZigzagLayout, on_device


def shift_left(x: torch.Tensor, shift: int, fill) -> torch.Tensor:
    """x[:, t + shift] at position t (dim 1), `fill` past the end; the CP=1 shift."""
    out = torch.full_like(x, fill)
    s = x.shape[1]
    if shift < s:
        out[:, : s - shift] = x[:, shift:]
    return out


@dataclass(frozen=True)
class ShiftPlan:
    """Index plan of a left shift by `shift` tokens (within each document) under CP.

    heads: [k] local positions every rank contributes to the all-gather (the
        first min(shift, chunk) tokens of each chunk); source: [local_length]
        index into cat(local tokens, all-gathered heads in rank order);
        valid: [local_length] bool, False where t + shift leaves the document.
    """

    heads: torch.Tensor
    source: torch.Tensor
    valid: torch.Tensor


@lru_cache(maxsize=64)
def shift_plan(layout: ZigzagLayout, rank: int, shift: int) -> ShiftPlan:
    """Pure index math of `cp_shift_left` for one rank."""
    if shift < 1:
        raise ValueError(f"shift must be >= 1, got {shift}")

    # Token t + shift sits in a later chunk at an offset below min(shift, chunk),
    # so the first min(shift, chunk) tokens of every chunk cover every source,
    # even when the shift spans several chunks of a short document.
    def heads_of(r):
        pos, local = [], 0
        for n in layout.doc_lengths:
            c = n // (2 * layout.cp_size)
            for _ in range(2):
                pos.append(torch.arange(local, local + min(shift, c)))
                local += c
        return torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)

    heads = heads_of(rank)
    local_global = layout.local_indices(rank)
    pool_global = torch.cat(
        [local_global] + [layout.local_indices(r)[heads_of(r)] for r in range(layout.cp_size)]
    )
    lookup = torch.full((layout.total_length,), -1, dtype=torch.long)
    # A rank's own heads appear twice in the pool (locally and gathered): same values.
    lookup[pool_global] = torch.arange(len(pool_global))
    doc_end = torch.repeat_interleave(
        torch.tensor([s + n for s, n in zip(layout.doc_starts, layout.doc_lengths)], dtype=torch.long),
        torch.tensor(layout.doc_lengths, dtype=torch.long),
    )[local_global]
    target = local_global + shift
    valid = target < doc_end
    source = torch.where(valid, lookup[target.clamp(max=max(layout.total_length - 1, 0))], 0)
    if bool((source[valid] < 0).any()):  # a bug in this function, not a user error
        raise AssertionError("zigzag shift plan is missing a source token")
    return ShiftPlan(heads, source, valid)


@lru_cache(maxsize=64)
def device_shift_plan(layout: ZigzagLayout, rank: int, shift: int, device: torch.device) -> ShiftPlan:
    """`shift_plan` on `device`, copied once per plan and device (every loss of every
    micro-batch asks for it)."""
    plan = shift_plan(layout, rank, shift)
    return ShiftPlan(*(on_device(t, torch.device(device)) for t in (plan.heads, plan.source, plan.valid)))


def cp_shift_left(x: torch.Tensor, shift: int, fill, layout: ZigzagLayout, rank: int,
                  group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """`shift_left` of the *global* sequence, for a rank-local zigzag tensor.

    Token t's value becomes token t+shift's (same document), which may live on
    another CP rank: each rank all-gathers the first min(shift, chunk) tokens
    of each of its chunks (<= 2 * shift per document, never the sequence).
    No gradient flows (used for labels, masks and the detached MTP teacher).

    Args:
        x: [b, local_length, ...] in local zigzag order.
    Returns:
        [b, local_length, ...], `fill` where t + shift leaves the document.
    """
    plan = device_shift_plan(layout, rank, shift, x.device)
    with torch.no_grad():
        heads = x.index_select(1, plan.heads).movedim(1, 0).contiguous()  # [k, b, ...]
        gathered = torch.empty((layout.cp_size * heads.shape[0], *heads.shape[1:]),
                               dtype=heads.dtype, device=heads.device)
        all_gather_single(gathered, heads, group=group)
        pool = torch.cat([x, gathered.movedim(0, 1)], dim=1)
        out = pool.index_select(1, plan.source)
        mask = (~plan.valid).view(1, -1, *([1] * (x.dim() - 2)))
        return out.masked_fill(mask, fill)
