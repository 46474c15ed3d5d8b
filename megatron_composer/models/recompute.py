"""megatron-core's MTP layer with full recompute that also takes packed sequences.

Under `--recompute-granularity full` megatron-core's `MultiTokenPredictionLayer`
hands every forward argument to `tensor_parallel.checkpoint`, whose autograd
function saves them with `save_for_backward`, which takes tensors only: a
packed batch's `PackedSeqParams` makes it fail. `RecomputedMTPLayer` passes
the tensors to the checkpoint and closes over the rest, as megatron-core's
`TransformerBlock` does for the decoder layers; what is recomputed is the same.
"""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer


class RecomputedMTPLayer(MultiTokenPredictionLayer):
    """MultiTokenPredictionLayer whose full recompute accepts non-tensor arguments."""

    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        if args or self.config.fp8 or self.config.recompute_method != "uniform":
            return super()._checkpointed_forward(forward_func, *args, **kwargs)
        names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
        others = {k: v for k, v in kwargs.items() if not torch.is_tensor(v)}

        def run(*tensors):
            return forward_func(**dict(zip(names, tensors)), **others)

        return tensor_parallel.checkpoint(run, self.config.distribute_saved_activations,
                                          *[kwargs[k] for k in names])


def recomputed_mtp_spec(mtp_block_spec):
    """The MTP block spec (megatron-core's, edited in place) with `RecomputedMTPLayer` layers."""
    for layer in mtp_block_spec.layer_specs:
        if layer.module is not MultiTokenPredictionLayer:
            raise ValueError(f"expected megatron-core's MultiTokenPredictionLayer in the MTP spec, got {layer.module}")
        layer.module = RecomputedMTPLayer
    return mtp_block_spec
