"""MXFP8 expert-parallel dispatch: the alltoall dispatcher sending E4M3 data + E8M0 scales.

Composer sends the MoE dispatch payload in MXFP8 and combines in BF16
(README "Low precision"): the dispatch carries 1 + 1/32 bytes per hidden
element instead of 2. megatron-core 0.16.1's `MoEAlltoAllTokenDispatcher`
sends the hidden states as they are; we subclass it (through
`moe.alltoall.DeviceCountsAlltoAllTokenDispatcher`, its sync-free form) and
override only `token_dispatch`, the step that calls `all_to_all` on the
permuted tokens:

    sender:   q = quantize_mxfp8(tokens)            tokens [T_send, hidden]
              all_to_all(q.data)   [T_send, hidden]        uint8 E4M3
              all_to_all(q.scale)  [T_send, hidden // 32]  uint8 E8M0
              (same splits: a token's scales travel with its data)
    receiver: dequantize_mxfp8(data, scale) -> [T_recv, hidden] in the tokens' dtype
    probs:    all_to_all in fp32, as megatron (4 bytes per routed token).

Everything else (routing, permutation, TP gathers, the combine all_to_all,
unpermutation) is megatron's. The received tokens equal
`fake_quantize(tokens, "mxfp8")` exactly, at any EP size: the quantization
is per 32 elements of one token, so it commutes with the exchange, and it is
applied at EP=1 too, so the numerics never depend on the EP layout. A token
holding inf/NaN arrives with its 32-element blocks that hold them all NaN
(E8M0 NaN scale), never an exception, so the step's loss turns non-finite.

Backward: the dispatch's gradient is the reverse all_to_all of the received
tokens' gradient, sent unquantized (in the gradient's dtype, BF16/fp32), with
the quantizer treated as the identity (straight-through), as FP8 training
recipes do for activation casts. The MoE backward GEMMs are MXFP8 already
(`quant/gemm.py`); quantizing this exchange too is left to a fused kernel.

On CUDA the quantize and dequantize are the Triton kernels (`quant/ops.py`,
bit-identical to the torch reference used elsewhere); neither syncs with the
host.

The spec selects `MXFP8DispatchMoELayer`, a `DeviceCountsMoELayer` (a
MoELayer that swaps in its dispatcher right after its own constructor) with
this dispatcher. The layer has no extra parameters or state.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from ..quant.formats import MXFP8_BLOCK, MXFP8Tensor
from ..quant.ops import dequantize_mxfp8, quantize_mxfp8
from .alltoall import DeviceCountsAlltoAllTokenDispatcher, DeviceCountsMoELayer

DISPATCH_PRECISIONS = ("bf16", "mxfp8")


def check_dispatch_hidden_size(hidden_size: int) -> None:
    """The MXFP8 payload blocks each token's hidden vector by 32; raise naming the size otherwise."""
    if hidden_size % MXFP8_BLOCK != 0:
        raise ValueError(
            f"--moe-dispatch-precision mxfp8 needs hidden_size to be a multiple of {MXFP8_BLOCK}, got "
            f"hidden_size {hidden_size}; use a hidden size such as "
            f"{hidden_size + (-hidden_size % MXFP8_BLOCK)} or --moe-dispatch-precision bf16"
        )


class MXFP8AllToAll(torch.autograd.Function):
    """Forward: all_to_all of MXFP8 data + scales, dequantized on arrival. Backward: plain reverse all_to_all."""

    @staticmethod
    def forward(ctx, group, tokens: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        """tokens [T_send, hidden] float -> [T_recv, hidden] same dtype; splits as megatron's all_to_all."""
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        q = quantize_mxfp8(tokens)
        data = all_to_all(group, q.data, output_splits, input_splits)
        scale = all_to_all(group, q.scale, output_splits, input_splits)
        return dequantize_mxfp8(MXFP8Tensor(data=data, scale=scale), tokens.dtype)

    @staticmethod
    def backward(ctx, grad_received: torch.Tensor):
        """grad_received [T_recv, hidden] -> grad of tokens [T_send, hidden], unquantized."""
        grad_tokens = all_to_all(ctx.group, grad_received, ctx.input_splits, ctx.output_splits)
        return None, grad_tokens, None, None


def mxfp8_all_to_all(group, tokens: torch.Tensor, output_splits=None, input_splits=None) -> torch.Tensor:
    """Exchange tokens over `group` as MXFP8 (see the module docstring).

    Args:
        group: the EP process group.
        tokens: [T_send, hidden] float32/bfloat16/float16, hidden % 32 == 0.
        output_splits: rows received from each rank (sequence of ints), None for equal splits.
        input_splits: rows sent to each rank, None for equal splits.
    Returns:
        [T_recv, hidden] in tokens.dtype, equal to fake_quantize(tokens, "mxfp8") rearranged.
    """
    return MXFP8AllToAll.apply(group, tokens, output_splits, input_splits)


class MXFP8AlltoAllTokenDispatcher(DeviceCountsAlltoAllTokenDispatcher):
    """megatron's alltoall dispatcher (sync-free form) with the token all_to_all in MXFP8."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        check_dispatch_hidden_size(config.moe_latent_size or config.hidden_size)
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)

    def token_dispatch(self, permutated_local_input_tokens: torch.Tensor, permuted_probs: torch.Tensor):
        """megatron's token_dispatch with the hidden-state all_to_all replaced by `mxfp8_all_to_all`.

        Args:
            permutated_local_input_tokens: [T_send, hidden], sorted by destination rank.
            permuted_probs: [T_send] float32.
        Returns:
            ([T_recv, hidden] dequantized tokens, [T_recv] probs).
        """
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        global_input_tokens = mxfp8_all_to_all(
            self.ep_group, permutated_local_input_tokens, self.output_splits, self.input_splits
        )
        global_probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        return global_input_tokens, global_probs


class MXFP8DispatchMoELayer(DeviceCountsMoELayer):
    """megatron's MoELayer with `MXFP8AlltoAllTokenDispatcher`."""

    dispatcher = MXFP8AlltoAllTokenDispatcher

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError(
                f"--moe-dispatch-precision mxfp8 quantizes the alltoall dispatcher, got "
                f"moe_token_dispatcher_type {config.moe_token_dispatcher_type!r}; use 'alltoall'"
            )
        check_dispatch_hidden_size(config.moe_latent_size or config.hidden_size)
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)


def quantized_dispatch_spec(moe_layer: ModuleSpec, precision: str, pg_collection=None) -> ModuleSpec:
    """megatron's MoELayer spec with our alltoall dispatcher, its payload in `precision`:
    "bf16" megatron's payload (`DeviceCountsMoELayer`), "mxfp8" `MXFP8DispatchMoELayer`.
    Any other MoE layer spec is returned unchanged for "bf16".

    TransformerLayer hands `pg_collection` only to the MoE classes it knows
    (and logs "Unknown MLP type ... Using default kwargs" for ours), so an
    explicit `pg_collection` rides in the spec's params; without one the layer
    uses megatron's default groups, as MoELayer itself does.
    """
    if precision not in DISPATCH_PRECISIONS:
        raise ValueError(f"--moe-dispatch-precision {precision!r} is not supported; use one of {DISPATCH_PRECISIONS}")
    if moe_layer.module is not MoELayer:
        if precision == "bf16":
            return moe_layer
        raise ValueError(f"--moe-dispatch-precision {precision} replaces megatron's MoELayer, got "
                         f"{moe_layer.module.__name__}")
    params = dict(moe_layer.params)
    if pg_collection is not None:
        params["pg_collection"] = pg_collection
    module = DeviceCountsMoELayer if precision == "bf16" else MXFP8DispatchMoELayer
    return ModuleSpec(module=module, params=params, submodules=moe_layer.submodules, metainfo=moe_layer.metainfo)
