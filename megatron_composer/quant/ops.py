"""The quantizers the training path calls: Triton kernels for CUDA tensors, `formats.py` elsewhere.

Both implementations produce the same bits (`triton_kernels.py` says how,
`tests/test_quant_kernels.py` checks it), so which one runs changes speed,
never numerics. The per-tensor NVFP4 recipe, kept for comparison only, has
no kernel and always runs the reference.

`TRITON_DEVICES` names the device types that get the kernels; the CPU test
suite adds "cpu" to run the kernels through Triton's interpreter.
"""
from __future__ import annotations

import importlib.util

import torch

from . import formats
from .formats import MXFP8Tensor, NVFP4Tensor

TRITON_DEVICES = {"cuda"}
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernels(x: torch.Tensor):
    """The Triton kernels module if x's device uses them, else None."""
    if _HAS_TRITON and x.device.type in TRITON_DEVICES:
        from . import triton_kernels

        return triton_kernels
    return None


def quantize_mxfp8(x: torch.Tensor) -> MXFP8Tensor:
    """`formats.quantize_mxfp8`; x [..., k] float32/bfloat16/float16, k % 32 == 0."""
    kernels = _kernels(x)
    return (kernels or formats).quantize_mxfp8(x)


def dequantize_mxfp8(q: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`formats.dequantize_mxfp8`: data [..., k], scale [..., k // 32] -> [..., k] dtype."""
    kernels = _kernels(q.data)
    return (kernels or formats).dequantize_mxfp8(q, dtype)


def quantize_nvfp4(x: torch.Tensor) -> NVFP4Tensor:
    """`formats.quantize_nvfp4` (per-token scale); x [..., k] float32/bfloat16/float16, k % 16 == 0."""
    kernels = _kernels(x)
    return (kernels or formats).quantize_nvfp4(x)


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`formats.dequantize_nvfp4`: data [..., k // 2] -> [..., k] dtype."""
    kernels = _kernels(q.data)
    return (kernels or formats).dequantize_nvfp4(q, dtype)


def quantize(x: torch.Tensor, fmt: str) -> MXFP8Tensor | NVFP4Tensor:
    """Quantize x [..., k] to `fmt` ("mxfp8", "nvfp4" or "nvfp4_per_tensor")."""
    if fmt == "mxfp8":
        return quantize_mxfp8(x)
    if fmt == "nvfp4":
        return quantize_nvfp4(x)
    if fmt == "nvfp4_per_tensor":
        return formats.quantize_nvfp4_per_tensor(x)
    raise ValueError(f"quantize: unknown format {fmt!r}; use one of {formats.FORMATS}")


def dequantize(q: MXFP8Tensor | NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize` for either tensor kind."""
    return dequantize_mxfp8(q, dtype) if isinstance(q, MXFP8Tensor) else dequantize_nvfp4(q, dtype)


def fake_quantize(x: torch.Tensor, fmt: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`formats.fake_quantize`: dequantize(quantize(x)), one fused kernel on the Triton path.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of the format's block.
        fmt: "mxfp8", "nvfp4" or "nvfp4_per_tensor".
        dtype: output dtype; None keeps x.dtype.
    Returns:
        [..., k] dtype.
    """
    kernels = _kernels(x)
    if kernels is not None and fmt in ("mxfp8", "nvfp4"):
        return kernels.fake_quantize(x, fmt, dtype)
    return formats.fake_quantize(x, fmt, dtype)
