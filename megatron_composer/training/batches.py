"""Micro-batches: which samples each data-parallel rank reads, and collation.

Sample order is a pure function of (consumed samples, global batch, DP rank),
so resuming at iteration N reads exactly what an uninterrupted run reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s] float32
    position_ids: torch.Tensor  # [b, s] int64
    segment_ids: torch.Tensor  # [b, s] int64, document index within each sample
    packed_seq_params: Optional[PackedSeqParams] = None  # "thd" when b == 1 packed


def micro_batch_indices(
    consumed_samples: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """Sample indices of each micro-batch this DP rank runs for one step.

    The global batch [consumed, consumed + global_batch) is cut into rounds of
    `micro_batch * dp_size`; in each round rank r takes the r-th slice (the
    layout of Megatron's pretraining sampler).
    """
    per_round = micro_batch * dp_size
    if global_batch % per_round:
        raise ValueError(
            f"--global-batch-size {global_batch} is not divisible by micro-batch-size x "
            f"data-parallel size = {micro_batch} x {dp_size}; use a multiple of {per_round}"
        )
    rounds = []
    for start in range(consumed_samples, consumed_samples + global_batch, per_round):
        first = start + dp_rank * micro_batch
        rounds.append(list(range(first, first + micro_batch)))
    return rounds


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[docs + 1] start offsets -> [seq_length] document index per token."""
    ids = torch.zeros(seq_length, dtype=torch.long)
    starts = cu_seqlens[1:-1].long()
    ids[starts[starts < seq_length]] = 1
    return ids.cumsum(0)


def collate(samples: list[dict], reset_attention_mask: bool = False) -> Batch:
    """Stack dataset samples into a micro-batch.

    With `reset_attention_mask`, the micro-batch is flattened into one packed
    "thd" sequence [1, b*s] whose cu_seqlens are every sample's documents, so
    each document attends only to itself.
    """
    tokens = torch.stack([s["tokens"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    loss_mask = torch.stack([s["loss_mask"] for s in samples]).float()
    position_ids = torch.stack([s["position_ids"] for s in samples])
    seq = tokens.shape[1]
    segments = torch.stack(
        [segment_ids_from_cu_seqlens(s["cu_seqlens"], seq) for s in samples]
    )
    if not reset_attention_mask:
        return Batch(tokens, labels, loss_mask, position_ids, segments)
    offsets, bounds, doc_base = 0, [0], 0
    for sample, seg in zip(samples, segments):
        cu = sample["cu_seqlens"].long().tolist()
        bounds.extend(offsets + c for c in cu[1:])
        offsets += seq
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    flat_segments = segment_ids_from_cu_seqlens(cu_seqlens, offsets)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )
    return Batch(
        tokens.reshape(1, -1),
        labels.reshape(1, -1),
        loss_mask.reshape(1, -1),
        position_ids.reshape(1, -1),
        flat_segments.unsqueeze(0),
        params,
    )
