"""MLA attention modules for megatron-core layer specs: CPU-capable core
attention on fused kernels chosen per device, and the latent-all-gather
context-parallel self-attention."""
from .core import MLACoreAttention
from .cp import (
    ContextParallelMLASelfAttention,
    ZigzagCoreAttention,
    attend_segments,
    latent_all_gather,
    reduce_scatter_sum,
)
from .kernels import causal_attention, packed_causal_attention, select_kernel

__all__ = [
    "ContextParallelMLASelfAttention",
    "MLACoreAttention",
    "ZigzagCoreAttention",
    "attend_segments",
    "causal_attention",
    "latent_all_gather",
    "packed_causal_attention",
    "reduce_scatter_sum",
    "select_kernel",
]
