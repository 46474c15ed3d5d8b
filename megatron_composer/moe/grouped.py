"""Routed experts in the model's dtype with one grouped GEMM per linear.

megatron-core's local `SequentialMLP` runs each local expert as its own
`MLP` module: per expert a split, two linears (each a megatron autograd
function), the activation, the probability multiply, and a final `cat`.
With many small experts that is mostly per-call overhead.
`GroupedSequentialMLP` computes the same function with one grouped GEMM per
linear over all local experts (`torch._grouped_mm`, the kernel behind
torch's grouped MoE layers; it runs on CPU in fp32/bf16/fp16 and on CUDA):

    x        [T, hidden]            tokens sorted by local expert (the dispatcher's order)
    ends     [E] int32              cumsum(tokens_per_expert): expert e owns rows ends[e-1]:ends[e]
    fc1      h = grouped_mm(x, W1^T, ends)        W1 = stack(local_experts.{e}.linear_fc1.weight) [E, 2*ffn, hidden]
    act      a = (silu(gate(h)) * up(h) * probs[:, None]).to(x.dtype)
    fc2      y = grouped_mm(a, W2^T, ends)        W2 = stack(local_experts.{e}.linear_fc2.weight) [E, hidden, ffn]

It departs from megatron-core only in how it multiplies: it is a
`SequentialMLP` subclass and keeps megatron's expert modules, so parameter
names and shapes (`local_experts.{e}.linear_fc1.weight`, ...), init,
expert attributes and sharded state dicts are unchanged; checkpoints, Muon's
per-expert parameter groups and HF conversion see no difference. The
activation and the probability multiply are MLP's unfused path, op for op,
including `moe_apply_probs_on_input`. On CPU each group's product is the same
GEMM megatron runs per expert, so in fp32 the result matches SequentialMLP to
rounding (tests/test_grouped_experts.py).

Stacking the expert weights copies them once per forward (2 small tensors per
layer on the tiny and small presets); GPU runs at full scale use Transformer
Engine's grouped experts instead. `torch._grouped_mm` needs every matrix
stride to be a multiple of 16 bytes; other sizes, and dtypes it lacks
(float64), run the same math as one `torch.mm` per expert (`grouped_linear`).
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` accepts these operands (dtype, 16-byte aligned strides)."""
    if x.dtype not in _GROUPED_MM_DTYPES or weight.dtype != x.dtype:
        return False
    align = 16 // x.element_size()
    return weight.shape[-1] % align == 0 and weight.shape[-2] % align == 0


def _group_slices(ends: torch.Tensor):
    bounds = [0] + ends.tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ weight[e].T for every group e (see `grouped_linear`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, ends)
        ctx.grouped = _grouped_mm_fits(x, weight)
        if ctx.grouped:
            return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
        out = x.new_empty(x.shape[0], weight.shape[1])
        for e, rows in enumerate(_group_slices(ends)):
            torch.mm(x[rows], weight[e].t(), out=out[rows])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        # _grouped_mm rejects broadcast (stride 0) gradients such as the one of a .sum()
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.grouped:
            if ctx.needs_input_grad[0]:
                grad_x = torch._grouped_mm(grad_out, weight, offs=ends)
            if ctx.needs_input_grad[1]:
                # 2-D x 2-D with offsets along the token dim: one [out, in] product per group
                # (zeros for a group without tokens)
                grad_w = torch._grouped_mm(grad_out.t(), x, offs=ends)
            return grad_x, grad_w, None
        slices = _group_slices(ends)
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x)
            for e, rows in enumerate(slices):
                torch.mm(grad_out[rows], weight[e], out=grad_x[rows])
        if ctx.needs_input_grad[1]:
            grad_w = torch.stack([grad_out[rows].t() @ x[rows] for rows in slices])
        return grad_x, grad_w, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """One linear per group of consecutive rows, as a single grouped GEMM.

    Args:
        x: [T, in] float, rows sorted by group.
        weight: [E, out, in] same dtype, one [out, in] matrix per group.
        ends: [E] int32 on x's device, cumulative row counts; ends[-1] == T.
    Returns:
        [T, out] in x.dtype; group e's rows ends[e-1]:ends[e] use weight[e].
    """
    return GroupedLinear.apply(x, weight, ends)


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP (same constructor, parameters and state dict) whose forward
    runs every local expert at once through `grouped_linear`.

    forward(permuted_local_hidden_states [T, hidden] sorted by local expert,
            tokens_per_expert [num_local_experts] int,
            permuted_probs [T] float32) -> (output [T, hidden] in the input dtype, None)
    """

    def __init__(self, num_local_experts: int, config, submodules: MLPSubmodules, pg_collection=None):
        unsupported = {
            "add_bias_linear": config.add_bias_linear,
            "bias_activation_fusion": config.bias_activation_fusion,
            "use_te_activation_func": config.use_te_activation_func,
            "fp8": config.fp8,
            "fp4": config.fp4,
        }
        bad = {k: v for k, v in unsupported.items() if v}
        if bad:
            raise ValueError(
                f"GroupedSequentialMLP runs megatron's unfused, bias-free expert MLP, got {bad}; "
                f"turn those off or build the model with grouped_experts=False (megatron's SequentialMLP)"
            )
        if submodules.linear_fc1 is not ColumnParallelLinear or submodules.linear_fc2 is not RowParallelLinear:
            raise ValueError(
                f"GroupedSequentialMLP multiplies the local spec's ColumnParallelLinear/RowParallelLinear "
                f"weights, got {submodules.linear_fc1} / {submodules.linear_fc2}; build the layer spec with "
                f"use_transformer_engine=False"
            )
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """MLP's unfused activation and per-token probability scale, op for op.

        h: [T, (2 if gated) * ffn]; probs: [T] float32 -> [T, ffn] in h.dtype.
        """
        config = self.config
        if config.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate = gate.clamp(min=None, max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            if config.glu_linear_offset:
                linear = linear + config.glu_linear_offset
            a = config.activation_func(gate) * linear
        else:
            a = config.activation_func(h)
        return (a * probs.unsqueeze(-1)).to(a.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """See the class docstring; the same contract as SequentialMLP.forward."""
        x = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError(
                    f"moe_apply_probs_on_input needs moe_router_topk 1, got {self.config.moe_router_topk}"
                )
            x = (permuted_probs.unsqueeze(-1) * x).to(x.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        counts = torch.as_tensor(tokens_per_expert)
        ends = counts.to(device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        w1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        w2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        h = grouped_linear(x, w1, ends)
        return grouped_linear(self._activation(h, permuted_probs), w2, ends), None


def grouped_experts_spec(experts: ModuleSpec) -> ModuleSpec:
    """The MoE layer's `experts` spec (megatron's SequentialMLP) as GroupedSequentialMLP."""
    if experts.module is not SequentialMLP:
        raise ValueError(
            f"grouped experts replace megatron's SequentialMLP (moe_grouped_gemm=False, local spec), got "
            f"{experts.module.__name__}"
        )
    return ModuleSpec(module=GroupedSequentialMLP, params=dict(experts.params), submodules=experts.submodules)
