"""Local-spec pieces for tensor parallelism (TP > 1, always with sequence parallelism).

Tensor parallelism runs with sequence parallelism: megatron-core's MoE layer
refuses TP without it in training, and its `finalize_model_grads` sums MLA's
latent-norm gradients over TP, which is right only when each TP rank normed
its own share of the sequence. Two local-spec pieces of megatron-core 0.16.1
do not fit that, so the local spec at TP > 1 gets these instead (TE's spec
needs neither: TE norms take sequence parallelism, and its MLA down-
projections are duplicated `TELinear`s):

* `SequenceParallelRMSNorm`: megatron-core's local norm (`WrappedTorchNorm`,
  torch.nn.RMSNorm) refuses sequence parallelism and its other local norm
  needs Apex. This is torch.nn.RMSNorm (same numerics and parameter name)
  whose weight is marked `sequence_parallel`, so `finalize_model_grads`
  all-reduces its gradient over TP.
* `TensorParallelMLASelfAttention`: with the local spec's column-parallel
  `linear_kv_down_proj`, megatron-core all-gathers the [s, b, (kv_lora + rope)
  / TP] output over TP and gives every rank the full shared RoPE key; in
  backward that gather only slices, so the RoPE key's gradient keeps one TP
  rank's heads and drops the others'. Here the down-projection's output is
  turned into the layout of a duplicated linear under sequence parallelism
  ([s / TP, b, kv_lora + rope]: columns all-gathered, own sequence shard kept),
  for which megatron-core gathers the RoPE key over the sequence and
  reduce-scatters its gradient, summing every rank's heads.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with megatron-core's norm constructor (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm is an RMSNorm, got normalization {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _sequence_shard_of_gathered_columns(module, args, output):
    """Forward hook: [s, b, c / TP] column shard -> [s / TP, b, c] sequence shard.
    Backward: all-gather the sequence, keep this rank's columns."""
    out, bias = output
    group = getattr(module, "tp_group", None)
    full = gather_from_tensor_model_parallel_region(out, group=group)
    return scatter_to_sequence_parallel_region(full, group=group), bias


class TensorParallelMLASelfAttention(MLASelfAttention):
    """megatron-core's MLASelfAttention whose column-parallel KV down-projection
    gives the sequence-parallel layout of a duplicated linear (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tp = get_pg_size(self.tp_group)
        if tp > 1:
            if not self.config.sequence_parallel:
                raise ValueError(f"TensorParallelMLASelfAttention needs sequence parallelism at TP={tp}")
            self.linear_kv_down_proj.register_forward_hook(_sequence_shard_of_gathered_columns)
