"""MXFP8 and NVFP4 block formats, quantized and dequantized exactly on any device.

These are the low-precision formats of the expert GEMMs (`quant/gemm.py`) and
of the MoE dispatch payload. Everything is a pure function of fp32 tensors
(bf16 and fp16 inputs are upcast; the upcast is exact), blocked along the last
dimension, and bit-exact: rounding to E4M3 and E2M1 is round-to-nearest-even
computed from the bit-level definition (`torch.frexp` plus power-of-two
division, which is exact), never a cast whose rounding the hardware chooses.

Element formats:
    E4M3 ('fn' flavour): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448
        (0x7E), subnormals down to 2**-9, no inf, 0x7F/0xFF are NaN. Encoding
        saturates at +-448 (+-inf included) and maps NaN to 0x7F/0xFF, sign
        kept, as torch's `float8_e4m3fn` cast does.
    E2M1: 1 sign (bit 3 of the nibble), 2 exponent (bias 1), 1 mantissa bit;
        magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Encoding saturates at +-6. It
        has no NaN: NaN saturates too, and NVFP4 carries NaN in its scales.
    E8M0: a bare exponent, value 2**(bits - 127); 0xFF is NaN.
Signed zeros keep their sign when encoded (E4M3 0x80, E2M1 nibble 0x8), as
torch's own `float8_e4m3fn` cast does; both decode to -0.0, which compares
equal to 0.0.

Block recipes:
    MXFP8: one E8M0 scale per 32 consecutive elements. The scale is 2**e with e
        the smallest integer such that amax(block) <= 448 * 2**e (clamped to
        [-127, 127]): the smallest power of two that keeps the block inside the
        E4M3 range, so nothing saturates. This departs from the OCP MX spec's
        `floor(log2(amax)) - 8`, which can saturate the block maximum.
    NVFP4 (per token): one fp32 `token_scale = amax(row) / 2688` per row (2688
        = 6 * 448), one E4M3 scale per 16 elements, `block_scale = E4M3(
        amax(block) / (6 * token_scale))`, elements `E2M1(x / (block_scale *
        token_scale))`. The standard NVFP4 recipe uses one fp32 scale for the
        whole tensor (`quantize_nvfp4_per_tensor`); a per-token scale makes a
        token's quantization independent of every other token in the batch
        (batch invariance, causality), at one fp32 per row.

Non-finite inputs (an overflowed activation, a NaN gradient) never raise:
they propagate as NaN to exactly the values whose scale they touch, so the
loss and gradients turn non-finite and the trainer's guard skips the step,
without a host sync or a data-dependent branch in the quantizer:
    MXFP8: a block holding inf or NaN gets the E8M0 NaN scale 0xFF; the OCP
        MX spec decodes every element of a NaN-scaled block as NaN, and so
        does `dequantize_mxfp8`. Other blocks are untouched.
    NVFP4 per token: a row holding inf or NaN gets token_scale NaN (and E4M3
        NaN block scales 0x7F) and decodes as all NaN; other rows are
        untouched.
    NVFP4 per tensor: the one tensor scale turns NaN, so every row does.

A last dimension that is not a multiple of the block size is rejected; pad it
with `pad_to_block` first (zeros never change a block's amax).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_SCALE_RANGE = E2M1_MAX * E4M3_MAX  # 2688: what token_scale maps amax(row) onto

_E4M3_MANT_BITS, _E4M3_EMIN = 3, -6
_E2M1_MANT_BITS, _E2M1_EMIN = 1, 0
_E8M0_BIAS = 127
_E8M0_NAN, _E4M3_NAN = 0xFF, 0x7F
_ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MXFP8Tensor:
    """An MXFP8-quantized tensor, blocked along its last dimension.

    Attributes:
        data: [..., k] uint8, E4M3 bit patterns.
        scale: [..., k // 32] uint8, E8M0 bit patterns (value 2**(bits - 127)).
    """

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: data plus scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


@dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-quantized tensor, blocked along its last dimension.

    Attributes:
        data: [..., k // 2] uint8, two E2M1 codes per byte; element 2j in the
            low nibble, element 2j + 1 in the high nibble.
        block_scale: [..., k // 16] uint8, E4M3 bit patterns.
        token_scale: [...] float32, one per row (x.shape[:-1]). For the
            per-tensor recipe every entry holds the same tensor scale.
    """

    data: torch.Tensor
    block_scale: torch.Tensor
    token_scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: data, block scales and token scales."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.block_scale, self.token_scale))


def pad_to_block(x: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad the last dimension up to a multiple of `block`.

    Zeros never raise a block's amax, so the padded elements change neither
    the scales nor the codes of the real ones; slice the dequantized result
    back with `[..., :x.shape[-1]]`.

    Args:
        x: [..., k] any dtype.
        block: block size, e.g. `MXFP8_BLOCK` or `NVFP4_BLOCK`.
    Returns:
        [..., ceil(k / block) * block], same dtype and device as x.
    """
    if block <= 0:
        raise ValueError(f"block {block} must be positive")
    pad = -x.shape[-1] % block
    if pad == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad))


def _exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2**e as exact fp32, built from its bit pattern.

    Args:
        e: any shape, integer dtype, values in [-149, 127].
    Returns:
        same shape, float32.
    """
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=0) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _encode_minifloat(x: torch.Tensor, mant_bits: int, emin: int, max_value: float, sign_bit: int,
                      top_code: int) -> torch.Tensor:
    """Round fp32 to a small float format by round-to-nearest-even, saturating.

    On the fp32 bit layout: `emin` is the exponent of the target's smallest
    normal, and the target quantum at fp32 exponent field E is
    2**(max(E - 127, emin) - mant_bits), built by masking and clamping the
    exponent bits (the clamp gives the subnormals). |x| / quantum is exact (a
    power-of-two division inside the normal range), `torch.round` rounds half
    to even, and the product back is exact. The rounded magnitude is a target
    value; multiplied by 2**-(126 + emin) it is an fp32 number whose bits,
    shifted right by 23 - mant_bits, are the target's exponent and mantissa
    fields, subnormals included. A NaN stays NaN through the arithmetic (|x|
    clears its sign), and the shifted bits of a positive fp32 NaN exceed every
    code, so clamping at `top_code` is the one step that maps NaN, with no
    extra pass over x.

    Args:
        x: any shape, float32; +-inf saturates.
        top_code: the largest magnitude code, which NaN maps to (the target's
            NaN where it has one); the NaN's sign bit is kept.
    Returns:
        same shape, uint8 codes, sign in bit `sign_bit`.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"encoding works on float32 bit patterns, got {x.dtype}; pass x.float()")
    bits = x.view(torch.int32)
    mag = x.abs()
    quantum_bits = (bits & 0x7F800000).clamp_(min=(127 + emin) << 23).sub_(mant_bits << 23)
    quantum = quantum_bits.view(torch.float32)
    rounded = mag.div_(quantum).round_().mul_(quantum).clamp_(max=max_value)
    code = rounded.mul_(2.0 ** -(126 + emin)).view(torch.int32).bitwise_right_shift_(23 - mant_bits)
    code = code.clamp_(max=top_code)
    sign = (bits >> 31).bitwise_and_(1 << sign_bit)
    return code.bitwise_or_(sign).to(torch.uint8)


def _minifloat_values(codes: torch.Tensor, mant_bits: int, exp_bits: int, emin: int) -> torch.Tensor:
    """Exact fp32 values of sign-magnitude small-float codes (int32), from the format definition."""
    field = (codes >> mant_bits) & ((1 << exp_bits) - 1)
    mant = codes & ((1 << mant_bits) - 1)
    normal = (mant + (1 << mant_bits)).float() * _exp2_int(field - 1 + emin - mant_bits)
    mag = torch.where(field == 0, mant.float() * 2.0 ** (emin - mant_bits), normal)
    return torch.where(((codes >> (exp_bits + mant_bits)) & 1) == 1, -mag, mag)


_DECODE_TABLES: dict = {}


def _decode_table(fmt: str, device: torch.device) -> torch.Tensor:
    """The value of every code of `fmt` ("e4m3" [256], "e2m1" [16]) on `device`.

    Built there from `torch.arange` and cached per device: a table copied from
    the host would cost a host-device transfer (a sync) per call.
    """
    key = (fmt, device)
    table = _DECODE_TABLES.get(key)
    if table is None:
        with torch.inference_mode(False):  # a plain tensor, usable outside inference mode too
            table = _build_decode_table(fmt, device)
        _DECODE_TABLES[key] = table
    return table


def _build_decode_table(fmt: str, device: torch.device) -> torch.Tensor:
    if fmt == "e4m3":
        table = _minifloat_values(torch.arange(256, dtype=torch.int32, device=device), _E4M3_MANT_BITS, 4, _E4M3_EMIN)
        table[0x7F] = table[0xFF] = float("nan")
        return table
    return _minifloat_values(torch.arange(16, dtype=torch.int32, device=device), _E2M1_MANT_BITS, 2, _E2M1_EMIN)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to E4M3 ('fn') by round-to-nearest-even, saturating at +-448.

    Args:
        x: any shape, float32; +-inf saturates to +-448.
    Returns:
        same shape, uint8 E4M3 bit patterns; 0x7F/0xFF (NaN, sign kept) only
        where x is NaN.
    """
    return _encode_minifloat(x, _E4M3_MANT_BITS, _E4M3_EMIN, E4M3_MAX, 7, top_code=_E4M3_NAN)


def decode_e4m3(bits: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns to their exact values.

    Args:
        bits: any shape, uint8.
    Returns:
        same shape, float32 (NaN for 0x7F/0xFF).
    """
    return _decode_table("e4m3", bits.device)[bits.long()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to E2M1 by round-to-nearest-even, saturating at +-6.

    Args:
        x: any shape, float32; +-inf saturates to +-6, and so does NaN,
            which E2M1 cannot encode (sign of the NaN kept).
    Returns:
        same shape, uint8 codes in [0, 15], sign in bit 3.
    """
    return _encode_minifloat(x, _E2M1_MANT_BITS, _E2M1_EMIN, E2M1_MAX, 3, top_code=0x7)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (one per uint8, low nibble) to their exact values.

    Args:
        codes: any shape, uint8 in [0, 15].
    Returns:
        same shape, float32.
    """
    return _decode_table("e2m1", codes.device)[codes.long()]


def decode_e8m0(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 bit patterns to 2**(bits - 127) as exact fp32, and 0xFF to NaN.

    Args:
        bits: any shape, uint8.
    Returns:
        same shape, float32.
    """
    value = _exp2_int(bits.to(torch.int32).clamp(max=_E8M0_NAN - 1) - _E8M0_BIAS)
    return torch.where(bits == _E8M0_NAN, float("nan"), value)


def check_quantizer_input(x: torch.Tensor, block: int, name: str) -> None:
    """Raise naming the dtype/shape and the fix unless x is a float32/bf16/fp16 [..., k], k % block == 0."""
    if x.dtype not in _ACCEPTED_DTYPES:
        raise TypeError(
            f"{name}: input dtype {x.dtype} is not supported; pass float32, bfloat16 or float16 "
            f"(cast float64 to float32 yourself so the extra rounding is explicit)"
        )
    if x.dim() == 0:
        raise ValueError(f"{name}: input is a 0-d tensor; blocks run along the last dimension, pass at least [k]")
    k = x.shape[-1]
    if k % block != 0:
        raise ValueError(
            f"{name}: last dimension {k} is not a multiple of the block size {block}; "
            f"pad it to {k + (-k % block)} with quant.pad_to_block(x, {block}) and slice the result back"
        )


def _checked_fp32(x: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """Validate a quantizer input and return it as fp32."""
    check_quantizer_input(x, block, name)
    return x.float()


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., k] -> [..., k // block, block] (a view where x's strides allow)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def quantize_mxfp8(x: torch.Tensor) -> MXFP8Tensor:
    """Quantize to MXFP8: E4M3 elements, one E8M0 scale per 32 along the last dim.

    Block scale 2**e, e the smallest integer with amax(block) <= 448 * 2**e,
    clamped to [-127, 127]; elements are E4M3(x / 2**e). An all-zero block gets
    scale bits 0 (2**-127) and zero data. A block holding inf or NaN gets the
    NaN scale 0xFF (`amax` propagates NaN, so one test per block finds it)
    and dequantizes to all NaN; its elements are encoded unscaled (e = 0),
    NaN as 0x7F/0xFF.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of 32.
    Returns:
        MXFP8Tensor with data [..., k] uint8 and scale [..., k // 32] uint8.
    """
    x = _checked_fp32(x, MXFP8_BLOCK, "quantize_mxfp8")
    blocks = _blocked(x, MXFP8_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    # amax = f * 2**p with f in [0.5, 1) and 448 = 0.875 * 2**9, so
    # amax <= 448 * 2**e  <=>  e >= p - 9 (f <= 0.875) or e >= p - 8 (f > 0.875).
    frac, p = torch.frexp(amax)
    e = torch.where(frac > 0.875, p - 8, p - 9)
    e = torch.where(amax == 0, -_E8M0_BIAS, e).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    e = torch.where(finite, e, 0)  # frexp of inf/NaN is device-defined; keep the data reproducible
    data = encode_e4m3(blocks / _exp2_int(e).unsqueeze(-1)).reshape(x.shape)
    scale = torch.where(finite, e + _E8M0_BIAS, _E8M0_NAN).to(torch.uint8)
    return MXFP8Tensor(data=data, scale=scale)


def dequantize_mxfp8(q: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact inverse of `quantize_mxfp8`'s encoding: E4M3 value * 2**(scale - 127).

    A NaN scale (0xFF) makes its whole block NaN, as the OCP MX spec decodes it.

    Args:
        q: MXFP8Tensor, data [..., k] uint8, scale [..., k // 32] uint8.
        dtype: output dtype; the values are exact in float32 (and bfloat16).
    Returns:
        [..., k] dtype.
    """
    k = q.data.shape[-1]
    if q.scale.shape[-1] * MXFP8_BLOCK != k or q.scale.shape[:-1] != q.data.shape[:-1]:
        raise ValueError(
            f"dequantize_mxfp8: scale shape {tuple(q.scale.shape)} does not match data shape "
            f"{tuple(q.data.shape)}; expected {tuple(q.data.shape[:-1]) + (k // MXFP8_BLOCK,)}"
        )
    values = _blocked(decode_e4m3(q.data), MXFP8_BLOCK)
    out = values * decode_e8m0(q.scale).unsqueeze(-1)
    return out.reshape(q.data.shape).to(dtype)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 codes -> [..., k // 2] uint8, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """[..., k // 2] uint8 -> [..., k] uint8 codes, inverse of `_pack_nibbles`."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])


def _nvfp4_blocks(x: torch.Tensor, block_amax: torch.Tensor, token_scale: torch.Tensor) -> NVFP4Tensor:
    """The NVFP4 block level of fp32 x [..., k], given its block amax [..., k // 16] and token scale [...]."""
    blocks = _blocked(x, NVFP4_BLOCK)
    ts = token_scale.unsqueeze(-1)
    # A NaN token scale (a non-finite row) gives the positive NaN code, whatever sign the NaN carries.
    block_scale = torch.where(torch.isnan(ts), _E4M3_NAN, encode_e4m3(block_amax / (E2M1_MAX * ts))).to(torch.uint8)
    denom = (decode_e4m3(block_scale) * ts).unsqueeze(-1)  # one fp32 product
    # A block whose scale rounds to zero (or whose product underflows) stores zeros, and so
    # does a NaN row, whose scales alone carry the NaN.
    usable = (denom != 0) & ~torch.isnan(denom)
    codes = torch.where(usable, encode_e2m1(blocks / torch.where(usable, denom, 1.0)),
                        torch.zeros((), dtype=torch.uint8, device=x.device))
    return NVFP4Tensor(
        data=_pack_nibbles(codes.reshape(x.shape)),
        block_scale=block_scale,
        token_scale=token_scale,
    )


def _token_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 2688, with 1 where that is zero (an all-zero row, or one that underflows)
    and NaN where amax is inf or NaN (every block scale of the row then encodes as NaN)."""
    scale = amax / NVFP4_SCALE_RANGE
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, float("nan"))


def quantize_nvfp4(x: torch.Tensor) -> NVFP4Tensor:
    """Quantize to NVFP4 with one fp32 scale per row (token) and E4M3 scales per 16.

    token_scale = amax(row) / 2688 (1 for an all-zero row, and for a row so
    small that this underflows to zero: its block scales then round to zero
    and it stores zeros); block_scale = E4M3(amax(block) / (6 * token_scale));
    element = E2M1(x / (block_scale * token_scale)). Every step is an IEEE fp32
    operation rounded to nearest; a block whose scale rounds to zero stores
    zero codes. Each row's result depends on that row alone; a row holding inf
    or NaN gets token_scale NaN, block scales 0x7F (NaN) and zero codes, and
    dequantizes to all NaN.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of 16.
    Returns:
        NVFP4Tensor with data [..., k // 2] uint8, block_scale [..., k // 16]
        uint8, token_scale [...] float32.
    """
    x = _checked_fp32(x, NVFP4_BLOCK, "quantize_nvfp4")
    block_amax = _blocked(x, NVFP4_BLOCK).abs().amax(dim=-1)
    row_amax = block_amax.amax(dim=-1) if block_amax.shape[-1] else block_amax.new_zeros(x.shape[:-1])
    return _nvfp4_blocks(x, block_amax, _token_scale_from_amax(row_amax))


def quantize_nvfp4_per_tensor(x: torch.Tensor) -> NVFP4Tensor:
    """Standard NVFP4: one fp32 scale amax(tensor) / 2688 for the whole tensor.

    Same block level as `quantize_nvfp4`; the tensor scale is broadcast into
    `token_scale` (every row holds the same value), so `dequantize_nvfp4`
    decodes both recipes. A row's result depends on every row of the tensor:
    one outlier token coarsens every other token's quantization, and one
    inf/NaN makes the tensor scale, hence every row, NaN.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of 16.
    Returns:
        NVFP4Tensor as `quantize_nvfp4`, token_scale [...] all equal.
    """
    x = _checked_fp32(x, NVFP4_BLOCK, "quantize_nvfp4_per_tensor")
    block_amax = _blocked(x, NVFP4_BLOCK).abs().amax(dim=-1)
    amax = block_amax.amax() if block_amax.numel() else block_amax.new_zeros(())
    scale = _token_scale_from_amax(amax).expand(x.shape[:-1]).contiguous()
    return _nvfp4_blocks(x, block_amax, scale)


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact inverse of the NVFP4 encoding: (e2m1 * block_scale) * token_scale.

    The product is taken in that order: e2m1 * block_scale is exact in fp32,
    so the only rounding is the final multiply by token_scale.

    Args:
        q: NVFP4Tensor, data [..., k // 2] uint8, block_scale [..., k // 16]
            uint8, token_scale [...] float32.
        dtype: output dtype (float32 keeps every value exact).
    Returns:
        [..., k] dtype.
    """
    k = q.data.shape[-1] * 2
    if q.block_scale.shape != q.data.shape[:-1] + (k // NVFP4_BLOCK,) or q.token_scale.shape != q.data.shape[:-1]:
        raise ValueError(
            f"dequantize_nvfp4: block_scale {tuple(q.block_scale.shape)} / token_scale "
            f"{tuple(q.token_scale.shape)} do not match data {tuple(q.data.shape)}; expected "
            f"{tuple(q.data.shape[:-1]) + (k // NVFP4_BLOCK,)} and {tuple(q.data.shape[:-1])}"
        )
    values = _blocked(decode_e2m1(_unpack_nibbles(q.data)), NVFP4_BLOCK)
    out = (values * decode_e4m3(q.block_scale).unsqueeze(-1)) * q.token_scale.float()[..., None, None]
    return out.reshape(*q.data.shape[:-1], k).to(dtype)


FORMATS = ("mxfp8", "nvfp4", "nvfp4_per_tensor")


def fake_quantize(x: torch.Tensor, fmt: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """dequantize(quantize(x)): the values a quantized operand carries.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of the format's block.
        fmt: "mxfp8", "nvfp4" (per-token scale) or "nvfp4_per_tensor".
        dtype: output dtype; None keeps x.dtype.
    Returns:
        [..., k] dtype.
    """
    dtype = x.dtype if dtype is None else dtype
    if fmt == "mxfp8":
        return dequantize_mxfp8(quantize_mxfp8(x), dtype)
    if fmt == "nvfp4":
        return dequantize_nvfp4(quantize_nvfp4(x), dtype)
    if fmt == "nvfp4_per_tensor":
        return dequantize_nvfp4(quantize_nvfp4_per_tensor(x), dtype)
    raise ValueError(f"fake_quantize: unknown format {fmt!r}; use one of {FORMATS}")
