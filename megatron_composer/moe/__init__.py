"""MoE pieces we hand megatron-core through the layer spec: grouped and quantized experts, MXFP8 dispatch.

`grouped`: SequentialMLP running all local experts with one grouped GEMM per
linear, in the model's dtype (the default experts). `experts`: SequentialMLP
whose expert GEMMs run through `quant.quantized_linear` (`--moe-expert-precision`).
`dispatcher`: the alltoall dispatcher with an MXFP8 dispatch payload
(`--moe-dispatch-precision`).
"""
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
from .grouped import GroupedLinear, GroupedSequentialMLP, grouped_experts_spec, grouped_linear

__all__ = [
    "DISPATCH_PRECISIONS",
    "EXPERT_PRECISIONS",
    "GroupedLinear",
    "GroupedSequentialMLP",
    "MXFP8AllToAll",
    "MXFP8AlltoAllTokenDispatcher",
    "MXFP8DispatchMoELayer",
    "QuantizedColumnParallelLinear",
    "QuantizedRowParallelLinear",
    "QuantizedSequentialMLP",
    "check_dispatch_hidden_size",
    "check_expert_precision",
    "grouped_experts_spec",
    "grouped_linear",
    "mxfp8_all_to_all",
    "quantized_dispatch_spec",
    "quantized_experts_spec",
]
