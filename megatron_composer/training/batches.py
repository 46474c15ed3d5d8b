"""Micro-batches: which samples each data-parallel rank reads, collation, and the copy to the device.

Sample order is a pure function of (consumed samples, global batch, DP rank),
so resuming at iteration N reads exactly what an uninterrupted run reads.
Batches are built on the host (collation, zigzag split, the CP shift plans
read `cu_seqlens` there) and then copied to the model's device once
(`Batch.to`), so the step's bookkeeping never reads them back from a GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..data import collate_packed
from ..parallel.zigzag import DOC_LENGTHS_ATTR, packed_doc_lengths


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s] float32
    position_ids: torch.Tensor  # [b, s] int64
    segment_ids: torch.Tensor  # [b, s] int64, document index within each sample
    packed_seq_params: Optional[PackedSeqParams] = None  # "thd" when b == 1 packed
    # [b, s] bool, True on pad tokens (the zigzag split's, a filler micro-batch's): the routers leave
    # them out of the expert-bias counts (`models.composer_forward`); None: no pad tokens
    padding_mask: Optional[torch.Tensor] = None

    def to(self, device: torch.device, non_blocking: bool = True) -> "Batch":
        """This batch on `device`: every tensor, the packed params' cu_seqlens included.

        Copies to CUDA go through pinned host memory with `non_blocking`, so they
        queue behind the running kernels instead of waiting for them. The
        `max_seqlen_*` of the packed params stay Python ints (kernels size their
        launch grids from them on the host).
        """
        device = torch.device(device)
        if device == self.tokens.device:
            return self
        pin = device.type == "cuda" and self.tokens.device.type == "cpu"

        def move(t):
            if not torch.is_tensor(t):
                return t
            return (t.pin_memory() if pin else t).to(device, non_blocking=non_blocking)

        params = self.packed_seq_params
        if params is not None:
            lengths = packed_doc_lengths(params) if params.qkv_format == "thd" else None  # read on the host
            params = dataclasses.replace(params, **{f.name: move(getattr(params, f.name))
                                                    for f in dataclasses.fields(params)
                                                    if torch.is_tensor(getattr(params, f.name))})
            if lengths is not None:
                setattr(params, DOC_LENGTHS_ATTR, lengths)
        fields = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids", "padding_mask")
        return dataclasses.replace(self, packed_seq_params=params, **{f: move(getattr(self, f)) for f in fields})


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
    batch = collate_packed(samples)
    b, seq = batch["tokens"].shape
    cu_seqlens = batch["cu_seqlens"]
    # document index of every token over the flattened batch, then per row
    segments = segment_ids_from_cu_seqlens(cu_seqlens, b * seq).reshape(b, seq)
    fields = [batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")]
    if not reset_attention_mask:
        return Batch(*fields, segments)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=batch["max_seqlen"],
        max_seqlen_kv=batch["max_seqlen"],
    )
    return Batch(*(f.reshape(1, -1) for f in fields), segments.reshape(1, -1), params)
