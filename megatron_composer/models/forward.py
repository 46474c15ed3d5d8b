"""One forward pass that returns main and MTP logits.

`GPTModel.forward` computes the MTP loss itself (plain cross-entropy on
shifted labels, attached to the hidden states), so its MTP logits never
leave the model. The Composer recipe trains MTP by self-distillation toward
the main head, which needs both distributions. `composer_forward` runs the
same modules in the same order as `GPTModel.forward` (embedding -> decoder
-> MTP block -> shared output layer) and returns the logits of every head.

Pad tokens (`padding_mask`, True: pad) are handed to the routers as
megatron-core's `padding_mask`, which leaves them out of the expert-bias
counts and the z-loss and changes nothing else: a batch padded for the
zigzag split (or a filler micro-batch) moves the expert biases exactly as its
unpadded tokens alone would. The MTP layers take the same, unrolled, mask
(`models.mtp`).

The logits stay in the model's dtype and in megatron's [s, b, v] storage
(returned as a [b, s, v] view): the losses upcast one chunk of positions at
a time (`training.losses`), so no full-vocabulary fp32 copy is ever made.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..parallel.wrappers import unwrap
from .mtp import NATIVE_PADDING_MASK


def composer_forward(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    packed_seq_params: Optional[PackedSeqParams] = None,
    padding_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the model.

    Args:
        model: a GPTModel built by `build_model` (wrappers are unwrapped).
        input_ids: [b, s] int64.
        position_ids: [b, s] int64 (MLA derives RoPE positions itself; kept for
            the embedding interface).
        packed_seq_params: "thd" packing with b == 1, or None.
        padding_mask: [b, s] bool, True on pad tokens (kept out of the routers' counts), or None.
    Returns:
        (logits [b, s, vocab], [mtp_logits [b, s, vocab] for each MTP depth]), in the
        model's dtype, each a transposed view of a contiguous [s, b, vocab] tensor.
        MTP depth k at position t predicts token t + k + 1.
    """
    gpt = unwrap(model)
    hidden = gpt.embedding(input_ids=input_ids, position_ids=position_ids)
    routing = {} if padding_mask is None else {"padding_mask": _routing_mask(gpt, padding_mask, input_ids)}
    hidden = gpt.decoder(hidden_states=hidden, attention_mask=None, packed_seq_params=packed_seq_params, **routing)
    depth = gpt.config.mtp_num_layers or 0
    if depth:
        hidden = gpt.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=hidden,
            attention_mask=None,
            packed_seq_params=packed_seq_params,
            embedding=gpt.embedding,
            **(routing if NATIVE_PADDING_MASK or not routing else {"extra_block_kwargs": routing}),
        )
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    heads = []
    for h in torch.chunk(hidden, 1 + depth, dim=0):
        logits, _ = gpt.output_layer(h, weight=weight, runtime_gather_output=True)
        heads.append(logits.transpose(0, 1))  # [s, b, v] -> [b, s, v] view, no copy
    return heads[0], heads[1:]


def _routing_mask(gpt, padding_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The [b, s] bool pad mask as the routers read it: this rank's sequence-parallel share of the
    positions when the embedding scattered them (as `GPTModel._preprocess` does)."""
    if padding_mask.shape != input_ids.shape:
        raise ValueError(f"padding_mask of shape {tuple(padding_mask.shape)} for input ids of shape "
                         f"{tuple(input_ids.shape)}; give one bool per token (True: a pad token)")
    mask = padding_mask.to(device=input_ids.device, dtype=torch.bool)
    if gpt.config.sequence_parallel:
        from megatron.core import tensor_parallel

        mask = tensor_parallel.scatter_to_sequence_parallel_region(mask.transpose(0, 1).contiguous())
        mask = mask.transpose(0, 1).contiguous()
    return mask
