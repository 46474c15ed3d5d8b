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

This module is the index math: pure functions of lengths and tensors,
tested against hand-computed indices in tests/test_zigzag.py. The index
tensors are cached per layout on the host and, once copied, per device, so
the layers of a step reuse them without a copy (`on_device`). Applying it
to a micro-batch is `zigzag_batch.py`; the cross-rank label shift is
`cp_shift.py`.
`ZigzagLayout(scheme="contiguous")` is the naive split (rank i holds chunks
2i, 2i+1); it exists only as the baseline the benchmarks compare against.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

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


# Attribute under which `packed_doc_lengths` memoizes on a PackedSeqParams.
DOC_LENGTHS_ATTR = "_composer_doc_lengths"


def packed_doc_lengths(packed_seq_params) -> tuple[int, ...]:
    """Document lengths of packed ("thd") params, from cu_seqlens(_padded).

    Memoized on the params object: every CP attention layer asks for the
    layout, and reading device cu_seqlens is a host sync. `training.Batch.to`
    records the lengths from the host copy before moving a batch, so a step
    on CUDA reads none from the device.
    """
    lengths = getattr(packed_seq_params, DOC_LENGTHS_ATTR, None)
    if lengths is None:
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        lengths = tuple((cu[1:] - cu[:-1]).tolist())
        setattr(packed_seq_params, DOC_LENGTHS_ATTR, lengths)
    return lengths

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
        layout = cls(packed_doc_lengths(packed_seq_params), cp_size, scheme)
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

    def local_indices(self, rank: int, device=None) -> torch.Tensor:
        """[local_length] int64: global token index of each of `rank`'s local tokens
        (a host copy; with `device`, the cached, read-only tensor there: see `on_device`)."""
        if device is not None:
            return _cached_on_device(_local_indices, (self, rank), torch.device(device))
        return _local_indices(self, rank).clone()

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """[local_length] int64: position of each local token within its document (RoPE)
        (a host copy; with `device`, the cached, read-only tensor there)."""
        if device is not None:
            return _cached_on_device(_positions, (self, rank), torch.device(device))
        return _positions(self, rank).clone()

    def gather_order(self) -> torch.Tensor:
        """[total_length]: global index of each row of a rank-major all-gather of local tokens."""
        return torch.cat([_local_indices(self, r) for r in range(self.cp_size)])

    def unzigzag_index(self, device=None) -> torch.Tensor:
        """[total_length]: `gathered.index_select(0, this)` puts an all-gather in global order
        (a host copy; with `device`, the cached, read-only tensor there)."""
        if device is not None:
            return _cached_on_device(_unzigzag_index, (self,), torch.device(device))
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


def on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for the device.

    To a GPU the copy goes from pinned memory with `non_blocking`, so it queues
    behind the running kernels (a pageable copy makes the host wait for them);
    for the CPU it is `host` itself.
    """
    if device.type == "cpu":
        return host
    source = host.pin_memory() if device.type == "cuda" else host
    return source.to(device, non_blocking=True)


@lru_cache(maxsize=256)
def _cached_on_device(plan, args: tuple, device: torch.device) -> torch.Tensor:
    """`plan(*args)` (a cached host index tensor) on `device`, copied once per plan and device:
    attention and the loss shift ask for it every layer and every micro-batch."""
    return on_device(plan(*args), device)


# --------------------------------------------------------------- tensors


def zigzag_split(x: torch.Tensor, layout: ZigzagLayout, rank: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s tokens of a global tensor.

    Args:
        x: [..., total_length (at `dim`), ...] any dtype.
    Returns:
        [..., local_length, ...], tokens in local (zigzag) order.
    """
    return x.index_select(dim, layout.local_indices(rank, x.device))


def zigzag_merge(parts: Sequence[torch.Tensor], layout: ZigzagLayout, dim: int = 1) -> torch.Tensor:
    """Inverse of `zigzag_split`: the per-rank tensors (rank order) back in global order."""
    merged = torch.cat(list(parts), dim=dim)
    return merged.index_select(dim, layout.unzigzag_index(merged.device))
