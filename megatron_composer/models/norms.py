"""A torch RMSNorm for the local spec under sequence parallelism.

megatron-core's local norm (`WrappedTorchNorm`, torch.nn.RMSNorm) refuses
sequence parallelism, and its other local norm (`FusedLayerNorm`) needs Apex.
Tensor parallelism with MoE layers needs sequence parallelism (megatron-core's
MoE layer refuses TP without it in training), and so do MLA's latent norms:
`finalize_model_grads` sums `q_layernorm` / `kv_layernorm` gradients over TP,
which is right only when each TP rank normed its own share of the sequence.

`SequenceParallelRMSNorm` is torch.nn.RMSNorm (same numerics and parameter
name as `WrappedTorchNorm`) whose weight is marked `sequence_parallel`, so
megatron-core's `finalize_model_grads` all-reduces its gradient over TP, as
it does for TE's norms. The local spec uses it only when TP > 1.
"""
from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with megatron-core's norm constructor (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm is an RMSNorm, got normalization {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
