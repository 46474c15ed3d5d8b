"""Quantized expert GEMMs `y = x @ w.T`, emulated exactly on any device.

Forward: both operands are quantized along `in`, the contraction dimension.
With "nvfp4", activations get one fp32 scale per token and weights the same
two-level scheme with each output channel (row of w) as the "token", so a
token's output depends on that token alone (batch invariance, causality);
"nvfp4_per_tensor" is the standard one-scale-per-tensor NVFP4, kept for
comparison. "mxfp8" runs the forward in MXFP8 too; "bf16" is the unquantized
baseline.

Backward (every quantized precision): MXFP8 operands requantized from the
saved high-precision x and w, never from the forward's quantized copies, so
nothing is quantized twice. Each backward GEMM blocks its operands along its
own contraction dimension:
    dgrad dx = dy @ w     contraction over `out`: dy blocked along its last
                          dim, w blocked along dim 0 (w.T along its last dim).
    wgrad dw = dy.T @ x   contraction over tokens: dy.T and x.T blocked along
                          tokens, zero-padded to a multiple of 32. Padding only
                          fills the last partial block and zeros never change a
                          block's amax, so it is exact.

Quantizers: `quant/ops.py`, i.e. the Triton kernels on CUDA and the torch
reference elsewhere, bit-identical. A `QuantizedWeight` (`quant/weights.py`)
passed as `cached` supplies the weight's two operands quantized once per
optimizer step; the result is exactly the uncached one.

Emulation: dequantize to fp32 and run an fp32 matmul, which equals a kernel
that accumulates the exact products in fp32, up to accumulation order. No
Transformer Engine kernel is wired in here; this emulation is the reference
such a kernel has to match. Results come back in the inputs' dtypes.

Non-finite operands never raise (no host sync, no data-dependent branch):
the quantizers turn an inf/NaN into NaN scales (`quant/formats.py`), and the
block that holds it feeds exactly the outputs an fp32 GEMM would make
non-finite: a bad x[t, i] reaches y[t, :] and dw[:, i], a bad w[o, i] reaches
y[:, o] and dx[:, i], a bad dy[t, o] reaches dx[t, :] and dw[o, :]. The loss
and gradients then turn non-finite and the trainer skips the step.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_composer.quant.formats import MXFP8_BLOCK, NVFP4_BLOCK, pad_to_block
from megatron_composer.quant.ops import fake_quantize
from megatron_composer.quant.weights import QuantizedWeight

PRECISIONS = ("bf16", "mxfp8", "nvfp4", "nvfp4_per_tensor")
_FORWARD_BLOCK = {"mxfp8": MXFP8_BLOCK, "nvfp4": NVFP4_BLOCK, "nvfp4_per_tensor": NVFP4_BLOCK}


def check_quantized_linear_shapes(x: torch.Tensor, weight: torch.Tensor, precision: str) -> None:
    """Raise a ValueError naming the value and the fix if the GEMM cannot run in `precision`.

    Args:
        x: [..., in] float.
        weight: [out, in] float.
        precision: one of PRECISIONS.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; use one of {PRECISIONS}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x shape {tuple(x.shape)} does not end in in_features {weight.shape[1]} of weight "
            f"{tuple(weight.shape)}; y = x @ w.T needs x [..., {weight.shape[1]}]"
        )
    if precision == "bf16":
        return
    in_features, out_features = weight.shape[1], weight.shape[0]
    block = _FORWARD_BLOCK[precision]
    if in_features % block != 0:
        raise ValueError(
            f"in_features {in_features} is not a multiple of the {precision} block {block}; "
            f"pad the expert's input dimension to {in_features + (-in_features % block)} or use precision 'bf16'"
        )
    if out_features % MXFP8_BLOCK != 0:
        raise ValueError(
            f"out_features {out_features} is not a multiple of the MXFP8 block {MXFP8_BLOCK} that the dgrad "
            f"blocks along; pad the expert's output dimension to {out_features + (-out_features % MXFP8_BLOCK)} "
            f"or use precision 'bf16'"
        )


def quantized_forward(x: torch.Tensor, weight: torch.Tensor, precision: str,
                      cached: Optional[QuantizedWeight] = None) -> torch.Tensor:
    """Forward GEMM with both operands quantized along `in`.

    Args:
        x: [tokens, in] float32/bfloat16/float16.
        weight: [out, in] float32/bfloat16/float16.
        precision: "mxfp8", "nvfp4" or "nvfp4_per_tensor".
        cached: weight's quantized operands, or None to quantize it here.
    Returns:
        [tokens, out] float32.
    """
    x_q = fake_quantize(x, precision, torch.float32)
    w_q = cached.forward(weight, precision) if cached is not None else fake_quantize(weight, precision, torch.float32)
    return x_q @ w_q.t()


def mxfp8_dgrad(grad_out: torch.Tensor, weight: torch.Tensor,
                cached: Optional[QuantizedWeight] = None) -> torch.Tensor:
    """dx = dy @ w with MXFP8 operands blocked along `out`.

    Args:
        grad_out: [tokens, out] float32/bfloat16/float16, out a multiple of 32.
        weight: [out, in] float32/bfloat16/float16.
        cached: weight's quantized operands, or None to quantize it here.
    Returns:
        [tokens, in] float32.
    """
    dy_q = fake_quantize(grad_out, "mxfp8", torch.float32)
    # [in, out], blocks along out. Contiguous, so the matmul's operand layout (hence its
    # summation order, hence its bits) never depends on the strides the quantizer passes through.
    if cached is not None:
        w_t_q = cached.dgrad(weight)
    else:
        w_t_q = fake_quantize(weight.t().contiguous(), "mxfp8", torch.float32)
    return dy_q @ w_t_q.t()


def mxfp8_wgrad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dw = dy.T @ x with MXFP8 operands blocked along tokens.

    Args:
        grad_out: [tokens, out] float32/bfloat16/float16, any token count.
        x: [tokens, in] float32/bfloat16/float16.
    Returns:
        [out, in] float32.
    """
    tokens = grad_out.shape[0]
    dy_t_q = fake_quantize(pad_to_block(grad_out.t(), MXFP8_BLOCK), "mxfp8", torch.float32)[:, :tokens]
    x_t_q = fake_quantize(pad_to_block(x.t(), MXFP8_BLOCK), "mxfp8", torch.float32)[:, :tokens]
    return dy_t_q @ x_t_q.t()


class QuantizedLinearFunction(torch.autograd.Function):
    """Autograd wrapper: quantized forward, MXFP8 backward from the saved high-precision operands."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, precision: str,
                cached: Optional[QuantizedWeight] = None) -> torch.Tensor:
        """x: [tokens, in], weight: [out, in]; returns [tokens, out] in x.dtype."""
        ctx.save_for_backward(x, weight)
        ctx.cached = cached
        return quantized_forward(x, weight, precision, cached).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        """grad_out: [tokens, out]; returns dx in x.dtype, dw in weight.dtype."""
        x, weight = ctx.saved_tensors
        dx = mxfp8_dgrad(grad_out, weight, ctx.cached).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = mxfp8_wgrad(grad_out, x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, precision: str = "nvfp4",
                     cached: Optional[QuantizedWeight] = None) -> torch.Tensor:
    """Expert GEMM y = x @ weight.T in a low-precision recipe.

    precision:
        "bf16": no quantization, a plain autograd matmul in x's dtype (weight
            is cast to x.dtype).
        "mxfp8": MXFP8 forward and backward.
        "nvfp4": NVFP4 forward with per-token (activations) and per-output-
            channel (weights) fp32 scales, MXFP8 backward.
        "nvfp4_per_tensor": standard NVFP4 forward (one fp32 scale per
            tensor), MXFP8 backward; for comparison only, it is neither batch
            invariant nor causal.
    Quantized precisions need in % 16 == 0 (nvfp4) or in % 32 == 0 (mxfp8),
    and out % 32 == 0; any token count works.

    Args:
        x: [..., in] float32/bfloat16/float16; leading dims are tokens.
        weight: [out, in] float32/bfloat16/float16.
        precision: one of PRECISIONS.
        cached: `WeightQuantCache.get(weight)`, the weight's operands quantized
            once per optimizer step; None quantizes the weight here. Same result.
    Returns:
        [..., out] in x.dtype (computed in fp32 for quantized precisions).
    """
    check_quantized_linear_shapes(x, weight, precision)
    if precision == "bf16":
        return torch.nn.functional.linear(x, weight.to(x.dtype))
    y = QuantizedLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, precision, cached)
    return y.reshape(*x.shape[:-1], weight.shape[0])
