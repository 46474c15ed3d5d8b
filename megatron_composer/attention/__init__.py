"""MLA attention modules for megatron-core layer specs: CPU-capable core
attention and the latent-all-gather context-parallel self-attention."""
from .core import MLACoreAttention, causal_attention, packed_causal_attention
from .cp import (
    ContextParallelMLASelfAttention,
    ZigzagCoreAttention,
    attend_segments,
    latent_all_gather,
    reduce_scatter_sum,
)

__all__ = [
    "ContextParallelMLASelfAttention",
    "MLACoreAttention",
    "ZigzagCoreAttention",
    "attend_segments",
    "causal_attention",
    "latent_all_gather",
    "packed_causal_attention",
    "reduce_scatter_sum",
]
