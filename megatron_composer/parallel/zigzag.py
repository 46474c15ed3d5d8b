"""Zigzag context-parallel split of sequences and packed documents.

A sequence (or, for packed "thd" batches, each document separately) is cut
into 2*CP equal chunks; CP rank i holds chunks i and 2*CP-1-i, in that order.
Under causal attention chunk j costs ~j, so every rank gets the same work
(the layout of the Composer report, of megatron-core's
`get_batch_on_this_cp_rank` and of torchtitan's `_HeadTailLoadBalancer`).
Packed documents are split one by one, so the rank-local tokens of a packed
batch are [doc0 chunk i, doc0 chunk 2CP-1-i, doc1 chunk i, ...] and the
`cu_seqlens` stay *global*: the convention megatron-core's `thd` + CP code
(`_roll_tensor_packed_seq`, `_get_thd_freqs_on_this_cp_rank`) assumes.

Everything here except `cp_shift_left` is a pure function of lengths and
tensors (tested against hand-computed indices in tests/test_zigzag.py).
`ZigzagLayout(scheme="contiguous")` is the naive split (rank i holds chunks
2i, 2i+1); it exists only as the baseline the benchmarks compare against.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .collectives import all_gather_single

SCHEMES = ("zigzag", "contiguous")


def zigzag_chunks(cp_size: int, rank: int) -> tuple[int, int]:
    """The two of the 2*cp_size chunks that CP rank `rank` holds: (rank, 2*cp_size-1-rank)."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"CP rank {rank} is outside CP size {cp_size}")
    return rank, 2 * cp_size - 1 - rank


def padded_length(length: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= length."""
    return -(-length // multiple) * multiple


def check_divisible(lengths: Sequence[int], cp_size: int, packed: bool) -> None:
    """Raise a ValueError naming the first length that 2*cp_size does not divide, and the fix."""
    multiple = 2 * cp_size
    for i, n in enumerate(lengths):
        if n % multiple:
            what = f"document {i} of length {n}" if packed else f"seq_len {n}"
            raise ValueError(
                f"{what} is not divisible by 2*cp={multiple}; pad to "
                f"{padded_length(n, multiple)} or use --pad-to-multiple"
            )


@dataclass(frozen=True)
class Segment:
    """One local query chunk and the global key range it attends to (causally).

    The chunk's queries are local tokens [q_start, q_end); they sit at the last
    q_end - q_start positions of the key range [k_start, k_end).
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int


@dataclass(frozen=True)
class ZigzagLayout:
    """How the tokens of one micro-batch row are spread over the CP ranks.

    Args:
        doc_lengths: global length of each unit that is split separately: the
            whole sequence ([s]) for plain batches, every document for packed
            ("thd") batches. Each must be divisible by 2 * cp_size.
        cp_size: context-parallel size.
        scheme: "zigzag" (ours) or "contiguous" (baseline for benchmarks).
    """

    doc_lengths: tuple[int, ...]
    cp_size: int
    scheme: str = "zigzag"

    def __post_init__(self):
        if self.cp_size < 1:
            raise ValueError(f"CP size must be >= 1, got {self.cp_size}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown split scheme {self.scheme!r}; choose one of {SCHEMES}")
        object.__setattr__(self, "doc_lengths", tuple(int(n) for n in self.doc_lengths))
        check_divisible(self.doc_lengths, self.cp_size, packed=len(self.doc_lengths) > 1)

    @classmethod
    def for_local_tokens(cls, local_length: int, cp_size: int, packed_seq_params=None,
                         scheme: str = "zigzag") -> "ZigzagLayout":
        """The layout of a rank-local batch: packed from its global `cu_seqlens`,
        plain from the local length (the sequence is local_length * cp_size)."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return cls((local_length * cp_size,), cp_size, scheme)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        layout = cls(tuple((cu[1:] - cu[:-1]).tolist()), cp_size, scheme)
        if layout.total_length != local_length * cp_size:
            raise ValueError(
                f"packed cu_seqlens cover {layout.total_length} tokens, but this rank holds "
                f"{local_length} x CP={cp_size} = {local_length * cp_size}; cu_seqlens must be "
                "the global (pre-split) document offsets"
            )
        return layout

    @property
    def total_length(self) -> int:
        return sum(self.doc_lengths)

    @property
    def local_length(self) -> int:
        return self.total_length // self.cp_size

    @property
    def doc_starts(self) -> tuple[int, ...]:
        starts, at = [], 0
        for n in self.doc_lengths:
            starts.append(at)
            at += n
        return tuple(starts)

    def chunks(self, rank: int) -> tuple[int, int]:
        """Chunk numbers (of 2*cp_size per document) that `rank` holds, in local order."""
        if self.scheme == "zigzag":
            return zigzag_chunks(self.cp_size, rank)
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"CP rank {rank} is outside CP size {self.cp_size}")
        return 2 * rank, 2 * rank + 1

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, slot 0/1) holding chunk number `chunk`."""
        for rank in range(self.cp_size):
            pair = self.chunks(rank)
            if chunk in pair:
                return rank, pair.index(chunk)
        raise ValueError(f"chunk {chunk} is outside 2*cp={2 * self.cp_size} chunks")

    def local_indices(self, rank: int) -> torch.Tensor:
        """[local_length] int64: global token index of each of `rank`'s local tokens."""
        return _local_indices(self, rank).clone()

    def positions(self, rank: int) -> torch.Tensor:
        """[local_length] int64: position of each local token within its document (RoPE)."""
        return _positions(self, rank).clone()

    def gather_order(self) -> torch.Tensor:
        """[total_length]: global index of each row of a rank-major all-gather of local tokens."""
        return torch.cat([_local_indices(self, r) for r in range(self.cp_size)])

    def unzigzag_index(self) -> torch.Tensor:
        """[total_length]: `gathered.index_select(0, this)` puts an all-gather in global order."""
        return _unzigzag_index(self).clone()

    def query_segments(self, rank: int) -> list[Segment]:
        """Local query chunks of `rank` with the causal key ranges they attend to."""
        segments, local = [], 0
        for start, n in zip(self.doc_starts, self.doc_lengths):
            c = n // (2 * self.cp_size)
            if c == 0:
                continue
            for chunk in self.chunks(rank):
                segments.append(Segment(local, local + c, start, start + (chunk + 1) * c))
                local += c
        return segments

    def causal_work(self, rank: int) -> int:
        """Number of (query, key) pairs `rank` scores under the causal mask."""
        work = 0
        for seg in self.query_segments(rank):
            c = seg.q_end - seg.q_start
            before = seg.k_end - seg.k_start - c  # keys every query of the chunk sees
            work += c * before + c * (c + 1) // 2
        return work


@lru_cache(maxsize=64)
def _local_indices(layout: ZigzagLayout, rank: int) -> torch.Tensor:
    parts = []
    for start, n in zip(layout.doc_starts, layout.doc_lengths):
        c = n // (2 * layout.cp_size)
        for chunk in layout.chunks(rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@lru_cache(maxsize=64)
def _positions(layout: ZigzagLayout, rank: int) -> torch.Tensor:
    parts = []
    for n in layout.doc_lengths:
        c = n // (2 * layout.cp_size)
        for chunk in layout.chunks(rank):
            parts.append(torch.arange(chunk * c, (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@lru_cache(maxsize=64)
def _unzigzag_index(layout: ZigzagLayout) -> torch.Tensor:
    return torch.argsort(layout.gather_order())


# --------------------------------------------------------------- tensors


def zigzag_split(x: torch.Tensor, layout: ZigzagLayout, rank: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s tokens of a global tensor.

    Args:
        x: [..., total_length (at `dim`), ...] any dtype.
    Returns:
        [..., local_length, ...], tokens in local (zigzag) order.
    """
    return x.index_select(dim, _local_indices(layout, rank).to(x.device))


def zigzag_merge(parts: Sequence[torch.Tensor], layout: ZigzagLayout, dim: int = 1) -> torch.Tensor:
    """Inverse of `zigzag_split`: the per-rank tensors (rank order) back in global order."""
    merged = torch.cat(list(parts), dim=dim)
    return merged.index_select(dim, _unzigzag_index(layout).to(merged.device))


@dataclass(frozen=True)
class PaddingPlan:
    """Where each token of the padded sequence comes from.

    source: [padded_total] index into the unpadded sequence (pad tokens point
        at their document's last token); is_pad: [padded_total] bool;
        step: [padded_total] int64, k for the k-th pad token of a document, else 0.
    """

    lengths: tuple[int, ...]
    source: torch.Tensor
    is_pad: torch.Tensor
    step: torch.Tensor


def document_padding(doc_lengths: Sequence[int], multiple: int) -> PaddingPlan:
    """Pad every document at its end up to a multiple of `multiple`."""
    sources, pads, steps, lengths, at = [], [], [], [], 0
    for n in doc_lengths:
        target = padded_length(n, multiple)
        extra = target - n
        sources.append(torch.arange(at, at + n))
        if extra:
            if n == 0:
                raise ValueError("cannot pad an empty document")
            sources.append(torch.full((extra,), at + n - 1))
        pads.append(torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(extra, dtype=torch.bool)]))
        steps.append(torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, extra + 1)]))
        lengths.append(target)
        at += n
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    return PaddingPlan(tuple(lengths), cat(sources, torch.long), cat(pads, torch.bool), cat(steps, torch.long))


def _batch_documents(batch) -> tuple[tuple[int, ...], bool]:
    params = batch.packed_seq_params
    if params is not None and params.qkv_format == "thd":
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        return tuple((cu[1:] - cu[:-1]).tolist()), True
    return (batch.tokens.shape[1],), False


def packed_seq_params_for(lengths: Sequence[int]):
    """"thd" PackedSeqParams for documents of these (global) lengths."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(lengths) if lengths else 0
    # Pad tokens are ordinary (loss-masked) tokens of their document, so the
    # padded offsets are also the "real" ones megatron's MTP roll reads.
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def pad_batch(batch, multiple: int, pad_token: int = 0):
    """Pad each document (packed) or each sequence (plain) to a multiple of `multiple`.

    Pad tokens and their labels are `pad_token` with loss_mask 0; they continue
    their document's position ids and keep its segment id. Returns a new batch
    (any dataclass with the fields of `training.batches.Batch`).
    """
    lengths, packed = _batch_documents(batch)
    plan = document_padding(lengths, multiple)
    if plan.lengths == lengths:
        return batch
    src, is_pad, step = plan.source, plan.is_pad[None, :], plan.step[None, :]
    take = lambda x: x.index_select(1, src)  # noqa: E731
    return dataclasses.replace(
        batch,
        tokens=torch.where(is_pad, pad_token, take(batch.tokens)),
        labels=torch.where(is_pad, pad_token, take(batch.labels)),
        loss_mask=torch.where(is_pad, 0.0, take(batch.loss_mask)).to(batch.loss_mask.dtype),
        position_ids=take(batch.position_ids) + step,
        segment_ids=take(batch.segment_ids),
        packed_seq_params=packed_seq_params_for(plan.lengths) if packed else None,
    )


def zigzag_batch(batch, cp_size: int, cp_rank: int, pad_to_multiple: bool = False, pad_token: int = 0):
    """This CP rank's share of a collated micro-batch (tokens, labels, loss mask,
    position ids, segment ids); packed batches keep their global cu_seqlens.

    Raises ValueError naming the length and the fix when a sequence/document is
    not divisible by 2*cp_size and `pad_to_multiple` is off.
    """
    if cp_size == 1:
        return batch
    lengths, packed = _batch_documents(batch)
    if pad_to_multiple:
        batch = pad_batch(batch, 2 * cp_size, pad_token)
        lengths, packed = _batch_documents(batch)
    layout = ZigzagLayout(lengths, cp_size)
    split = lambda x: zigzag_split(x, layout, cp_rank, dim=1)  # noqa: E731
    return dataclasses.replace(
        batch,
        tokens=split(batch.tokens),
        labels=split(batch.labels),
        loss_mask=split(batch.loss_mask),
        position_ids=split(batch.position_ids),
        segment_ids=split(batch.segment_ids),
        packed_seq_params=packed_seq_params_for(lengths) if packed else None,
    )


# --------------------------------------------------------------- shifts


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
    local_global = _local_indices(layout, rank)
    pool_global = torch.cat(
        [local_global] + [_local_indices(layout, r)[heads_of(r)] for r in range(layout.cp_size)]
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
    plan = shift_plan(layout, rank, shift)
    with torch.no_grad():
        heads = x.index_select(1, plan.heads.to(x.device)).movedim(1, 0).contiguous()  # [k, b, ...]
        gathered = torch.empty((layout.cp_size * heads.shape[0], *heads.shape[1:]),
                               dtype=heads.dtype, device=heads.device)
        all_gather_single(gathered, heads, group=group)
        pool = torch.cat([x, gathered.movedim(0, 1)], dim=1)
        out = pool.index_select(1, plan.source.to(x.device))
        mask = (~plan.valid).to(x.device).view(1, -1, *([1] * (x.dim() - 2)))
        return out.masked_fill(mask, fill)
