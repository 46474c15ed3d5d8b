"""Routed experts in the model's dtype with one grouped GEMM per linear.

megatron-core's local `SequentialMLP` runs each local expert as its own
`MLP` module: per expert a split, two linears (each a megatron autograd
function), the activation, the probability multiply, and a final `cat`.
With many small experts that is mostly per-call overhead.
`GroupedSequentialMLP` computes the same function with one grouped GEMM per
linear over all local experts (`torch._grouped_mm`, the kernel behind
torch's grouped MoE layers; it runs on CPU in fp32/bf16/fp16 and on CUDA):

    x        [T, hidden]            tokens sorted by local expert (the dispatcher's order)
    ends     [E] int32              cumsum(tokens_per_expert) on x's device: expert e owns rows ends[e-1]:ends[e]
    fc1      h = grouped_mm(x, W1^T, ends)        W1 [E, 2*ffn, hidden]: local_experts.{e}.linear_fc1.weight = W1[e]
    act      a = (silu(gate(h)) * up(h) * probs[:, None]).to(x.dtype)
    fc2      y = grouped_mm(a, W2^T, ends)        W2 [E, hidden, ffn]:   local_experts.{e}.linear_fc2.weight = W2[e]

It departs from megatron-core only in how it multiplies and where the
weights live: it is a `SequentialMLP` subclass and keeps megatron's expert
modules, so parameter names and shapes (`local_experts.{e}.linear_fc1.weight`,
...), init, expert attributes and sharded state dicts are unchanged;
checkpoints, Muon's per-expert parameter groups and HF conversion see no
difference. The activation and the probability multiply are MLP's unfused
path, op for op, including `moe_apply_probs_on_input`, or with
`bias_activation_fusion` megatron's fused weighted SwiGLU, the call MLP makes.
On CPU each group's product is the same GEMM megatron runs per expert, so in
fp32 the result matches SequentialMLP to rounding (tests/test_grouped_experts.py).

Weights. At construction each linear's local expert weights are packed into
one contiguous [E, out, in] tensor, and every expert's parameter becomes the
view of its row: the parameters stay megatron's (one per expert, same names,
same optimizer state), while the forward reads W1 and W2 as views without
copying. The packing survives `load_state_dict` (an in-place copy) and is
redone after `.to()`/`.cuda()`. Anything that moves a parameter's storage
elsewhere (megatron's distributed-optimizer buffers, FSDP2's all-gathered
parameters) leaves the experts correct: the forward then stacks the weights,
a copy per forward.

Host syncs: none. The token counts may arrive on the device (the alltoall
dispatcher of `moe.alltoall` keeps them there at EP=1) or on the host
(megatron's dispatcher at EP>1 copies them there); host counts go to the
device with a non-blocking copy, and the grouped GEMMs read only the device
offsets. `torch._grouped_mm` needs every matrix stride to be a multiple of 16
bytes; other sizes, and dtypes it lacks (float64), run the same math as one
`torch.mm` per expert (`grouped_linear`), which reads the offsets on the host.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
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


def packed_view(weights: Sequence[torch.Tensor]):
    """The [E, out, in] tensor whose rows are `weights` (E tensors [out, in]) when they are
    consecutive rows of one contiguous storage (`pack_weights`); None otherwise. No copy."""
    first = weights[0]
    if type(first) not in (torch.Tensor, torch.nn.Parameter):
        return None
    nbytes = first.numel() * first.element_size()
    if first.untyped_storage().nbytes() < first.storage_offset() * first.element_size() + len(weights) * nbytes:
        return None
    base = first.data_ptr()
    for e, w in enumerate(weights):
        if (type(w) is not type(first) or w.dtype != first.dtype or w.shape != first.shape
                or not w.is_contiguous() or w.data_ptr() != base + e * nbytes):
            return None
    return first.detach().as_strided((len(weights), *first.shape), (first.numel(), *first.stride()))


def pack_weights(weights: Sequence[torch.nn.Parameter]) -> None:
    """Move the parameters `weights` (E tensors [out, in]) into one new [E, out, in] storage,
    each the view of its row, keeping their values and Parameter objects (see `packed_view`)."""
    packed = torch.stack([w.detach() for w in weights])
    for e, w in enumerate(weights):
        w.data = packed[e]


class GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ weights[e].T for every group e (see `grouped_linear`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        weight = packed_view(weights)
        if weight is None:
            weight = torch.stack(weights)
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
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[2:])
        if ctx.grouped:
            if need_x:
                grad_x = torch._grouped_mm(grad_out, weight, offs=ends)
            if need_w:
                # 2-D x 2-D with offsets along the token dim: one [out, in] product per group
                # (zeros for a group without tokens)
                grad_w = torch._grouped_mm(grad_out.t(), x, offs=ends)
        else:
            slices = _group_slices(ends)
            if need_x:
                grad_x = torch.empty_like(x)
                for e, rows in enumerate(slices):
                    torch.mm(grad_out[rows], weight[e], out=grad_x[rows])
            if need_w:
                grad_w = torch.stack([grad_out[rows].t() @ x[rows] for rows in slices])
        grad_ws = grad_w.unbind(0) if grad_w is not None else (None,) * weight.shape[0]
        return (grad_x, None, *grad_ws)


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], ends: torch.Tensor) -> torch.Tensor:
    """One linear per group of consecutive rows, as a single grouped GEMM.

    Args:
        x: [T, in] float, rows sorted by group.
        weights: E tensors [out, in] of x's dtype, one per group: the rows of one packed
            [E, out, in] tensor (`pack_weights`, read without a copy) or any tensors (stacked).
        ends: [E] int32 on x's device, cumulative row counts; ends[-1] == T.
    Returns:
        [T, out] in x.dtype; group e's rows ends[e-1]:ends[e] use weights[e].
    """
    return GroupedLinear.apply(x, ends, *weights)


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP (same constructor, parameters and state dict) whose forward
    runs every local expert at once through `grouped_linear`.

    forward(permuted_local_hidden_states [T, hidden] sorted by local expert,
            tokens_per_expert [num_local_experts] int, on the host or x's device,
            permuted_probs [T] float32) -> (output [T, hidden] in the input dtype, None)
    """

    def __init__(self, num_local_experts: int, config, submodules: MLPSubmodules, pg_collection=None):
        unsupported = {
            "add_bias_linear": config.add_bias_linear,
            "use_te_activation_func": config.use_te_activation_func,
            "fp8": config.fp8,
            "fp4": config.fp4,
        }
        bad = {k: v for k, v in unsupported.items() if v}
        if bad:
            raise ValueError(
                f"GroupedSequentialMLP runs megatron's bias-free expert MLP, got {bad}; "
                f"turn those off or build the model with grouped_experts=False (megatron's SequentialMLP)"
            )
        if config.bias_activation_fusion:
            check_fused_swiglu(config)
        if submodules.linear_fc1 is not ColumnParallelLinear or submodules.linear_fc2 is not RowParallelLinear:
            raise ValueError(
                f"GroupedSequentialMLP multiplies the local spec's ColumnParallelLinear/RowParallelLinear "
                f"weights, got {submodules.linear_fc1} / {submodules.linear_fc2}; build the layer spec with "
                f"use_transformer_engine=False"
            )
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        self._pack()

    def _expert_weights(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        return ([expert.linear_fc1.weight for expert in self.local_experts],
                [expert.linear_fc2.weight for expert in self.local_experts])

    def _packed(self) -> bool:
        return all(packed_view(weights) is not None for weights in self._expert_weights())

    def _pack(self) -> None:
        for weights in self._expert_weights():
            pack_weights(weights)

    def _apply(self, fn, recurse=True):
        """Module._apply (`.to()`, `.cuda()`, `.half()`, ...), packing the weights again
        if they were packed before and the conversion gave them new storages."""
        packed = self._packed()
        out = super()._apply(fn, recurse)
        if packed and not self._packed():
            self._pack()
        return out

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """MLP's activation and per-token probability scale, op for op (fused or not).

        h: [T, (2 if gated) * ffn]; probs: [T] float32 -> [T, ffn] in h.dtype.
        """
        config = self.config
        if config.bias_activation_fusion:
            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store)
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
        # host counts: a non-blocking copy (a blocking one would wait for the whole stream)
        counts = tokens_per_expert.to(x.device, non_blocking=True)
        ends = counts.cumsum(0, dtype=torch.int32)
        w1, w2 = self._expert_weights()
        h = grouped_linear(x, w1, ends)
        return grouped_linear(self._activation(h, permuted_probs), w2, ends), None


def check_fused_swiglu(config) -> None:
    """Raise naming the setting if megatron's fused weighted SwiGLU (`bias_activation_fusion`)
    would not compute this config's expert activation: it is SiLU-gated, without clamp or offset."""
    bad = {
        "activation_func": None if config.activation_func is F.silu else config.activation_func,
        "gated_linear_unit": None if config.gated_linear_unit else False,
        "activation_func_clamp_value": config.activation_func_clamp_value,
        "glu_linear_offset": config.glu_linear_offset or None,
    }
    bad = {k: v for k, v in bad.items() if v is not None}
    if bad:
        raise ValueError(
            f"bias_activation_fusion runs megatron's fused weighted SwiGLU (silu, gated, no clamp, no "
            f"offset), which does not compute {bad}; turn bias_activation_fusion off"
        )


def grouped_experts_spec(experts: ModuleSpec) -> ModuleSpec:
    """The MoE layer's `experts` spec (megatron's SequentialMLP) as GroupedSequentialMLP."""
    if experts.module is not SequentialMLP:
        raise ValueError(
            f"grouped experts replace megatron's SequentialMLP (moe_grouped_gemm=False, local spec), got "
            f"{experts.module.__name__}"
        )
    return ModuleSpec(module=GroupedSequentialMLP, params=dict(experts.params), submodules=experts.submodules)
