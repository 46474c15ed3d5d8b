"""Quantized routed experts: megatron-core's SequentialMLP with NVFP4/MXFP8 GEMMs.

Composer runs the MoE expert GEMMs in NVFP4 forward and MXFP8 backward
(README "Low precision"). megatron-core 0.16.1 has low-precision experts only
through Transformer Engine (TEGroupedMLP with `config.fp8`/`config.fp4`), and
TE's NVFP4 uses one fp32 scale per tensor, the recipe Composer rejected. So we
keep everything megatron-core does around the GEMMs (token split per expert,
SwiGLU, the routing-probability multiply between fc1 and fc2,
`moe_apply_probs_on_input`, bias handling, sharded checkpoints) and replace
only the matmul of each expert's two linears by `quant.quantized_linear`:

    QuantizedSequentialMLP  = SequentialMLP whose experts' MLPSubmodules are
    QuantizedColumnParallelLinear (linear_fc1, fused gate/up [2*ffn, hidden])
    QuantizedRowParallelLinear    (linear_fc2, [hidden, ffn])

The linears subclass megatron's and override `_forward_impl`, the one method
that multiplies, so parameters, their names (`local_experts.{i}.linear_fc1.
weight`, ...), shapes, init, `allreduce`/expert attributes and sharded state
dicts are megatron's own: checkpoints, Muon's per-expert grouping and HF
conversion see no difference. Selected through the layer spec
(`quantized_experts_spec`), never by patching megatron-core.

Each linear keeps its weight's quantized operands in a `WeightQuantCache`
(`quant/weights.py`): quantized once per optimizer step and reused by every
micro-batch (and by activation recompute), with results equal to quantizing
afresh. On CUDA the quantizers are the Triton kernels (`quant/ops.py`).

Expert TP > 1 needs nothing more (untested here): expert linears then do no
communication of their own (megatron's `explicit_expert_comm`), so
`_forward_impl` is a local GEMM on the weight shard, whose dims must still be
block multiples.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size

from ..quant.gemm import check_quantized_linear_shapes, quantized_linear
from ..quant.weights import WeightQuantCache

EXPERT_PRECISIONS = ("bf16", "mxfp8", "nvfp4")


def check_expert_precision(hidden_size: int, moe_ffn_hidden_size: int, precision: str,
                           gated: bool = True, expert_tp: int = 1) -> None:
    """Raise a ValueError naming the size and the flag if the experts cannot run in `precision`.

    fc1: x [tokens, hidden] @ w [(2 if gated) * ffn / expert_tp, hidden].T;
    fc2: x [tokens, ffn / expert_tp] @ w [hidden, ffn / expert_tp].T.
    Quantized precisions need every `in` a multiple of the forward block (16
    for nvfp4, 32 for mxfp8) and every `out` a multiple of 32 (the MXFP8 dgrad
    blocks along it).
    """
    if precision not in EXPERT_PRECISIONS:
        raise ValueError(f"--moe-expert-precision {precision!r} is not supported; use one of {EXPERT_PRECISIONS}")
    ffn_shard = moe_ffn_hidden_size // expert_tp
    fc1_out = (2 if gated else 1) * ffn_shard
    meta = dict(device="meta")
    for name, x, w in (
        ("linear_fc1", torch.empty(0, hidden_size, **meta), torch.empty(fc1_out, hidden_size, **meta)),
        ("linear_fc2", torch.empty(0, ffn_shard, **meta), torch.empty(hidden_size, ffn_shard, **meta)),
    ):
        try:
            check_quantized_linear_shapes(x, w, precision)
        except ValueError as exc:
            raise ValueError(
                f"--moe-expert-precision {precision} with hidden_size {hidden_size}, moe_ffn_hidden_size "
                f"{moe_ffn_hidden_size} (expert TP {expert_tp}): expert {name} {exc}"
            ) from None


class _QuantizedExpertGemm:
    """Mixin for megatron's parallel linears: `_forward_impl` runs `quantized_linear`.

    megatron calls `_forward_impl(input, weight, bias, gradient_accumulation_fusion,
    allreduce_dgrad, sequence_parallel, ...)`. Expert linears never all-reduce
    dgrads nor run sequence parallel inside the linear (the dispatcher owns the
    communication), so those must be off. Gradient-accumulation fusion is
    ignored: the weight gradient lands in `.grad`, which megatron's DDP hook
    adds to `main_grad` like any unfused parameter's.
    """

    precision: str
    weight_quant_cache: WeightQuantCache

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                      allreduce_dgrad: bool = False, sequence_parallel: bool = False, **_unused) -> torch.Tensor:
        """input [..., in], weight [out, in] -> [..., out] in input.dtype."""
        if allreduce_dgrad or sequence_parallel:
            raise ValueError(
                f"{type(self).__name__}: quantized expert GEMMs run on local shards only, got "
                f"allreduce_dgrad={allreduce_dgrad}, sequence_parallel={sequence_parallel}; "
                f"use them only as routed-expert linears (is_expert=True)"
            )
        out = quantized_linear(input, weight, self.precision, cached=self.weight_quant_cache.get(weight))
        return out if bias is None else out + bias


class QuantizedColumnParallelLinear(_QuantizedExpertGemm, ColumnParallelLinear):
    """megatron's ColumnParallelLinear (expert linear_fc1) with a quantized GEMM."""

    def __init__(self, *args, precision: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.precision = precision
        self.weight_quant_cache = WeightQuantCache()


class QuantizedRowParallelLinear(_QuantizedExpertGemm, RowParallelLinear):
    """megatron's RowParallelLinear (expert linear_fc2) with a quantized GEMM."""

    def __init__(self, *args, precision: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.precision = precision
        self.weight_quant_cache = WeightQuantCache()


class QuantizedSequentialMLP(SequentialMLP):
    """SequentialMLP whose experts multiply through `quantized_linear(x, w, precision)`.

    Same constructor as SequentialMLP plus `precision` (one of
    EXPERT_PRECISIONS; the spec passes it). Same forward:
        permuted_local_hidden_states: [tokens, hidden], tokens sorted by local expert.
        tokens_per_expert: [num_local_experts] int64 (CPU).
        permuted_probs: [tokens] float32, applied after the activation (or on
            the input with `moe_apply_probs_on_input`), as megatron does.
    Returns (output [tokens, hidden] in the input dtype, None).
    """

    def __init__(self, num_local_experts: int, config, submodules: MLPSubmodules,
                 pg_collection=None, precision: str = "nvfp4"):
        expert_tp = get_pg_size(pg_collection.expt_tp) if pg_collection is not None else 1
        check_expert_precision(config.hidden_size, config.moe_ffn_hidden_size, precision,
                               gated=config.gated_linear_unit, expert_tp=expert_tp)
        if submodules.linear_fc1 is not ColumnParallelLinear or submodules.linear_fc2 is not RowParallelLinear:
            raise ValueError(
                f"QuantizedSequentialMLP replaces the local spec's ColumnParallelLinear/RowParallelLinear, "
                f"got {submodules.linear_fc1} / {submodules.linear_fc2}; build the layer spec with "
                f"use_transformer_engine=False"
            )
        submodules = dataclasses.replace(
            submodules,
            linear_fc1=ModuleSpec(module=QuantizedColumnParallelLinear, params={"precision": precision}),
            linear_fc2=ModuleSpec(module=QuantizedRowParallelLinear, params={"precision": precision}),
        )
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        self.precision = precision


def quantized_experts_spec(experts: ModuleSpec, precision: str) -> ModuleSpec:
    """The MoE layer's `experts` spec running in `precision`.

    "bf16" returns `experts` unchanged (megatron's SequentialMLP); otherwise a
    QuantizedSequentialMLP spec on the same submodules.
    """
    if precision not in EXPERT_PRECISIONS:
        raise ValueError(f"--moe-expert-precision {precision!r} is not supported; use one of {EXPERT_PRECISIONS}")
    if precision == "bf16":
        return experts
    if experts.module is not SequentialMLP:
        raise ValueError(
            f"--moe-expert-precision {precision} needs SequentialMLP experts (moe_grouped_gemm=False, "
            f"local spec), got {experts.module.__name__}"
        )
    return ModuleSpec(module=QuantizedSequentialMLP, params={"precision": precision}, submodules=experts.submodules)
