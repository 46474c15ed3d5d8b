"""The zigzag split applied to a collated micro-batch: padding, packed params, per-rank share.

Pure functions of a batch (any dataclass with the fields of
`training.batches.Batch`); the index math they use is in `zigzag.py`.

Pad tokens are marked in the batch's `padding_mask` (True: pad), which the
model hands its routers (`models.composer_forward`): megatron-core's router
leaves them out of the expert-bias counts (and the z-loss), so a padded
batch moves the biases exactly as the unpadded one does. Everything else
about a pad token (its output, its loss mask 0) is unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from .zigzag import ZigzagLayout, padded_length, zigzag_split


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


_BATCH_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids", "packed_seq_params",
                 "padding_mask")


def extra_token_fields(batch) -> list[str]:
    """Per-token fields beyond `Batch`'s ([b, s, ...] tensors, e.g. RL advantages or routing
    records); they are padded with `batch.PAD_VALUES[name]` and split like the tokens."""
    return [f.name for f in dataclasses.fields(batch) if f.name not in _BATCH_FIELDS
            and torch.is_tensor(getattr(batch, f.name))
            and tuple(getattr(batch, f.name).shape[:2]) == tuple(batch.tokens.shape)]


def pad_batch(batch, multiple: int, pad_token: int = 0):
    """Pad each document (packed) or each sequence (plain) to a multiple of `multiple`.

    Pad tokens and their labels are `pad_token` with loss_mask 0; they continue
    their document's position ids, keep its segment id and are True in
    `padding_mask` (with the batch's own pad tokens, if it marks any). Returns a
    new batch (any dataclass with the fields of `training.batches.Batch`).
    """
    lengths, packed = _batch_documents(batch)
    plan = document_padding(lengths, multiple)
    if plan.lengths == lengths:
        return batch
    src, is_pad, step = plan.source, plan.is_pad[None, :], plan.step[None, :]
    take = lambda x: x.index_select(1, src)  # noqa: E731
    fills = getattr(batch, "PAD_VALUES", {})
    extra = {}
    for name in extra_token_fields(batch):
        value = take(getattr(batch, name))
        pad = is_pad.reshape(*is_pad.shape, *([1] * (value.dim() - 2)))
        extra[name] = torch.where(pad, torch.tensor(fills.get(name, 0), dtype=value.dtype), value)
    padding = is_pad if batch.padding_mask is None else is_pad | take(batch.padding_mask)
    return dataclasses.replace(
        batch,
        **extra,
        tokens=torch.where(is_pad, pad_token, take(batch.tokens)),
        labels=torch.where(is_pad, pad_token, take(batch.labels)),
        loss_mask=torch.where(is_pad, 0.0, take(batch.loss_mask)).to(batch.loss_mask.dtype),
        position_ids=take(batch.position_ids) + step,
        segment_ids=take(batch.segment_ids),
        packed_seq_params=packed_seq_params_for(plan.lengths) if packed else None,
        padding_mask=padding.expand(batch.tokens.shape[0], -1).clone(),
    )


def zigzag_batch(batch, cp_size: int, cp_rank: int, pad_to_multiple: bool = False, pad_token: int = 0):
    """This CP rank's share of a collated micro-batch (tokens, labels, loss mask,
    position ids, segment ids, padding mask); packed batches keep their global cu_seqlens.

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
        **{name: split(getattr(batch, name)) for name in extra_token_fields(batch)},
        tokens=split(batch.tokens),
        labels=split(batch.labels),
        loss_mask=split(batch.loss_mask),
        position_ids=split(batch.position_ids),
        segment_ids=split(batch.segment_ids),
        packed_seq_params=packed_seq_params_for(lengths) if packed else None,
        padding_mask=None if batch.padding_mask is None else split(batch.padding_mask),
    )
