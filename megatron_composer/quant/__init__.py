"""Low-precision formats (MXFP8, NVFP4) and quantized expert GEMMs, exact on any device.

`formats` holds the pure quantize/dequantize functions, the reference (the
ones exported here); `triton_kernels` the same recipes as Triton kernels, bit
for bit; `ops` picks the kernels for CUDA tensors and the reference
elsewhere, and is what the training path calls. `gemm` has the autograd GEMM
`quantized_linear(x, w, precision)` for MoE experts, `weights` the cache that
quantizes each expert weight once per optimizer step. The MXFP8 dispatch
payload is `quantize_mxfp8(x)` -> (`data`, `scale`) on the sender and
`dequantize_mxfp8(MXFP8Tensor(data, scale), dtype)` on the receiver.
"""
from megatron_composer.quant.formats import (
    E2M1_MAX,
    E4M3_MAX,
    FORMATS,
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    MXFP8Tensor,
    NVFP4Tensor,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    dequantize_mxfp8,
    dequantize_nvfp4,
    encode_e2m1,
    encode_e4m3,
    fake_quantize,
    pad_to_block,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_nvfp4_per_tensor,
)
from megatron_composer.quant.gemm import (
    PRECISIONS,
    QuantizedLinearFunction,
    check_quantized_linear_shapes,
    mxfp8_dgrad,
    mxfp8_wgrad,
    quantized_forward,
    quantized_linear,
)
from megatron_composer.quant.weights import QuantizedWeight, WeightQuantCache, invalidate_quantized_weights

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "FORMATS",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "PRECISIONS",
    "QuantizedLinearFunction",
    "QuantizedWeight",
    "WeightQuantCache",
    "check_quantized_linear_shapes",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "encode_e2m1",
    "encode_e4m3",
    "fake_quantize",
    "invalidate_quantized_weights",
    "mxfp8_dgrad",
    "mxfp8_wgrad",
    "pad_to_block",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_per_tensor",
    "quantized_forward",
    "quantized_linear",
]
