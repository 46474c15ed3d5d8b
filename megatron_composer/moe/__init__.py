"""MoE pieces we hand megatron-core through the layer spec: grouped and quantized experts, MXFP8 dispatch.

`grouped`: SequentialMLP running all local experts with one grouped GEMM per
linear, in the model's dtype (the default experts). `experts`: SequentialMLP
whose expert GEMMs run through `quant.quantized_linear` (`--moe-expert-precision`).
`alltoall`: megatron's alltoall dispatcher without host syncs when every
expert is local (the default MoE layer). `dispatcher`: that dispatcher with an
MXFP8 dispatch payload (`--moe-dispatch-precision`). `router`: megatron's
top-k router with pad tokens kept out of its expert-bias counts.
"""
from .alltoall import DeviceCountsAlltoAllTokenDispatcher, DeviceCountsMoELayer, permute_by_expert
from .dispatcher import (
    DISPATCH_PRECISIONS,
    MXFP8AllToAll,
    MXFP8AlltoAllTokenDispatcher,
    MXFP8DispatchMoELayer,
    check_dispatch_hidden_size,
    mxfp8_all_to_all,
    quantized_dispatch_spec,
)
from .experts import (
    EXPERT_PRECISIONS,
    QuantizedColumnParallelLinear,
    QuantizedRowParallelLinear,
    QuantizedSequentialMLP,
    check_expert_precision,
    quantized_experts_spec,
)
from .router import PaddingAwareTopKRouter, padding_aware_router_spec
from .grouped import (
    GroupedLinear,
    GroupedSequentialMLP,
    check_fused_swiglu,
    grouped_experts_spec,
    grouped_linear,
    pack_weights,
    packed_view,
)

__all__ = [
    "DISPATCH_PRECISIONS",
    "DeviceCountsAlltoAllTokenDispatcher",
    "DeviceCountsMoELayer",
    "EXPERT_PRECISIONS",
    "GroupedLinear",
    "GroupedSequentialMLP",
    "MXFP8AllToAll",
    "MXFP8AlltoAllTokenDispatcher",
    "MXFP8DispatchMoELayer",
    "QuantizedColumnParallelLinear",
    "QuantizedRowParallelLinear",
    "PaddingAwareTopKRouter",
    "QuantizedSequentialMLP",
    "check_dispatch_hidden_size",
    "check_expert_precision",
    "check_fused_swiglu",
    "grouped_experts_spec",
    "grouped_linear",
    "mxfp8_all_to_all",
    "pack_weights",
    "packed_view",
    "padding_aware_router_spec",
    "permute_by_expert",
    "quantized_dispatch_spec",
    "quantized_experts_spec",
]
