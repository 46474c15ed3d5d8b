"""megatron-core's MTP layer, with two departures: a packed batch is rolled
without reading the device, and full recompute takes packed sequences.

1. **Packed roll.** Before each MTP depth, megatron-core rolls the input ids
   and position ids one token left within each document. For a packed
   ("thd") batch it loops over the documents and slices with `cu_seqlens`
   values read from the device (`_roll_tensor_packed_seq`): two host syncs
   and a handful of kernels per document per depth. At CP = 1 the packed roll
   equals megatron-core's plain roll of the ids with each document's first
   token zeroed beforehand (the plain roll moves token t+1 to t and zeroes the
   last position; a zeroed first token of the next document is exactly the
   zero the packed roll writes at a document's end). `ComposerMTPLayer` does
   that with one cached device mask per packing and hands megatron-core's own
   embedding step the batch as unpacked. Under CP > 1 the zigzag halves of
   each document are exchanged by megatron-core's packed roll, unchanged.
2. **Full recompute with packed sequences.** Under `--recompute-granularity
   full` megatron-core hands every forward argument to
   `tensor_parallel.checkpoint`, whose autograd function saves them with
   `save_for_backward`, which takes tensors only: a packed batch's
   `PackedSeqParams` makes it fail. The tensors go to the checkpoint and the
   rest is closed over, as megatron-core's `TransformerBlock` does for the
   decoder layers; what is recomputed is the same.
3. **Pad tokens, unrolled.** `padding_mask` (True: a pad token, which the
   routers leave out of the expert-bias counts) is the decoder's, at every
   depth: MTP position t (the hidden state of token t, the embedding of
   token t + 1) is a pad position exactly when token t is a pad token, so a
   padded batch counts the positions of its unpadded one. megatron-core >= 0.18
   rolls the mask with the ids instead (position t would take token t + 1's
   flag: a document's last real position out, its last pad position in); its
   rolled mask is replaced by the given one. Before 0.18 the MTP layer takes
   no mask, and the given one reaches its transformer layer's router through
   a forward pre-hook installed for the call (and carried through full
   recompute).
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

from ..parallel.zigzag import on_device, packed_doc_lengths


# megatron-core >= 0.18: the MTP layer takes, rolls and returns a padding mask itself
NATIVE_PADDING_MASK = "padding_mask" in inspect.signature(MultiTokenPredictionLayer.forward).parameters


@lru_cache(maxsize=256)
def _document_starts(doc_lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[sum(doc_lengths)] bool, True at the first token of each document (on `device`, copied once)."""
    starts = torch.zeros(sum(doc_lengths), dtype=torch.bool)
    offsets = torch.tensor((0,) + doc_lengths[:-1], dtype=torch.long).cumsum(0)
    starts[offsets[torch.tensor(doc_lengths) > 0]] = True
    return on_device(starts, device)


def zero_document_starts(x: torch.Tensor, doc_lengths: tuple[int, ...]) -> torch.Tensor:
    """x [b, s] with the first token of every document set to 0 (s == sum(doc_lengths))."""
    if x.shape[-1] != sum(doc_lengths):
        raise ValueError(f"packed ids of {x.shape[-1]} tokens, but the documents cover {sum(doc_lengths)}")
    return x.masked_fill(_document_starts(doc_lengths, x.device), 0)


class ComposerMTPLayer(MultiTokenPredictionLayer):
    """MultiTokenPredictionLayer with a sync-free packed roll at CP = 1, a full recompute
    that accepts non-tensor arguments and the decoder's pad tokens unrolled (the module docstring)."""

    _routing_padding = None  # before megatron-core 0.18: this call's padding mask, for the router

    def forward(self, *args, padding_mask=None, **kwargs):
        if NATIVE_PADDING_MASK:
            return super().forward(*args, padding_mask=padding_mask, **kwargs)
        self._routing_padding = padding_mask
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._routing_padding = None

    def _get_embeddings(self, input_ids, position_ids, *args, packed_seq_params=None, **kwargs):
        cp_size = self.cp_group.size() if getattr(self, "cp_group", None) is not None else 1
        if packed_seq_params is not None and cp_size == 1:
            lengths = packed_doc_lengths(packed_seq_params)
            input_ids = zero_document_starts(input_ids, lengths)
            position_ids = zero_document_starts(position_ids, lengths)
            packed_seq_params = None  # the plain roll of the masked ids is the packed roll
        out = super()._get_embeddings(input_ids, position_ids, *args, packed_seq_params=packed_seq_params, **kwargs)
        if "padding_mask" in kwargs:  # megatron-core >= 0.18: (ids, positions, mask, input, hidden)
            out = (*out[:2], kwargs["padding_mask"], *out[3:])
        return out

    def _proj_and_transformer_layer(self, *args, routing_padding=None, **kwargs):
        mask = routing_padding if routing_padding is not None else self._routing_padding
        if mask is None:
            return super()._proj_and_transformer_layer(*args, **kwargs)

        def with_mask(module, layer_args, layer_kwargs):
            return layer_args, {**layer_kwargs, "padding_mask": mask}

        hook = self.transformer_layer.register_forward_pre_hook(with_mask, with_kwargs=True)
        try:
            return super()._proj_and_transformer_layer(*args, **kwargs)
        finally:
            hook.remove()

    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        if self._routing_padding is not None:  # recomputed in backward, after `forward` returned
            kwargs["routing_padding"] = self._routing_padding
        if args or self.config.fp8 or self.config.recompute_method != "uniform":
            return super()._checkpointed_forward(forward_func, *args, **kwargs)
        names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
        others = {k: v for k, v in kwargs.items() if not torch.is_tensor(v)}

        def run(*tensors):
            return forward_func(**dict(zip(names, tensors)), **others)

        return tensor_parallel.checkpoint(run, self.config.distribute_saved_activations,
                                          *[kwargs[k] for k in names])


def composer_mtp_spec(mtp_block_spec):
    """The MTP block spec (megatron-core's, edited in place) with `ComposerMTPLayer` layers."""
    for layer in mtp_block_spec.layer_specs:
        if layer.module is not MultiTokenPredictionLayer:
            raise ValueError(f"expected megatron-core's MultiTokenPredictionLayer in the MTP spec, got {layer.module}")
        layer.module = ComposerMTPLayer
    return mtp_block_spec
