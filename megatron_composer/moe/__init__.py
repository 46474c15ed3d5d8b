"""MoE pieces we hand megatron-core through the layer spec: quantized experts, MXFP8 dispatch.

`experts`: SequentialMLP whose expert GEMMs run through `quant.quantized_linear`
(`--moe-expert-precision`). `dispatcher`: the alltoall dispatcher with an
MXFP8 dispatch payload (`--moe-dispatch-precision`).
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

__all__ = [
    "DISPATCH_PRECISIONS",
    "EXPERT_PRECISIONS",
    "MXFP8AllToAll",
    "MXFP8AlltoAllTokenDispatcher",
    "MXFP8DispatchMoELayer",
    "QuantizedColumnParallelLinear",
    "QuantizedRowParallelLinear",
    "QuantizedSequentialMLP",
    "check_dispatch_hidden_size",
    "check_expert_precision",
    "mxfp8_all_to_all",
    "quantized_dispatch_spec",
    "quantized_experts_spec",
]
