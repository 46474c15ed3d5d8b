"""Triton kernels for MXFP8 and per-token NVFP4 quantize / dequantize, bit-exact to `formats.py`.

`formats.py` is the reference: pure torch, exact on any device, but a chain
of a dozen full-size elementwise passes. These kernels do the same recipe in
one pass over the input (two for NVFP4: the per-token amax, then the
blocks), with no host sync: the grid depends on shapes only, and non-finite
blocks are handled with `tl.where`, never a branch on data. They are ours,
not Transformer Engine's: TE's NVFP4 has one global scale per tensor, not
per token, TE is not bit-specified against this reference, and the
emulated expert path must run where TE is not installed.

Bit-exactness: every step is the reference's own IEEE fp32 operation, or an
integer operation on bit patterns that gives the same value:
    - the division by a power of two (MXFP8 block scale, the rounding
      quantum) is a multiplication by the exact reciprocal power of two (both
      round the same real number);
    - round-half-to-even to the quantum grid is `(v + 2**23) - 2**23` on
      v < 16, exact IEEE addition;
    - the NVFP4 divisions are `tl.math.div_rn` (IEEE round-to-nearest;
      Triton's `/` compiles to the approximate `div.full.f32`);
    - block amax is a max over finite magnitudes plus a separate non-finite
      flag, because Triton's max may drop NaN where torch's amax keeps it;
    - the E4M3/E2M1 code of a rounded magnitude is read from its exponent and
      mantissa bits (normal) or as an integer multiple of the smallest
      subnormal, never through an fp32 subnormal;
    - bf16 input is widened by shifting its bits, and bf16 output is rounded
      to nearest even on the bits (NaN -> 0x7FC0, as torch does), because
      Triton's interpreter truncates in its own fp32 -> bf16 cast.
No product here is followed by an addition of a rounded value, so fused
multiply-add contraction cannot change a result. Subnormal fp32 inputs and
results must not be flushed to zero; Triton's plain fp32 arithmetic keeps
them. A CPU test compiles the kernels for sm_90 and checks the PTX for both
(no `.ftz`, no approximate division); the CUDA test feeds fp32 subnormals.

On CUDA the kernels compile; on a machine without CUDA they are built with
Triton's interpreter (numpy), which runs them on CPU tensors: that is how the
CPU test suite checks them bit for bit against `formats.py`. The training
path calls them only for CUDA tensors (`quant/ops.py`). The interpreter is
chosen per function here, not by TRITON_INTERPRET before triton's import
(megatron-core imports triton first), so triton.language's own jit helpers
stay compiled-only: the kernels use builtins (`tl.full`, not `tl.zeros`) and
reduce with `tl.reduce` and tl.max's combine function, which the interpreter
recognizes and runs as numpy's max.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .formats import MXFP8_BLOCK, NVFP4_BLOCK, MXFP8Tensor, NVFP4Tensor, check_quantizer_input

if torch.cuda.is_available():
    _jit = triton.jit
else:  # the interpreter runs the same kernels on CPU tensors
    from triton.runtime.interpreter import InterpretedFunction as _jit

_MAX = tl.standard._elementwise_max  # tl.max's combine; the interpreter runs it as numpy's max

_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # written in the kernel; others cast after


# ---------------------------------------------------------------- element helpers
@_jit
def _load_fp32(ptrs, mask, IN_BF16: tl.constexpr):
    """Load float32/float16 (or bf16 viewed as int16) and widen exactly to fp32."""
    if IN_BF16:
        raw = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return (raw << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@_jit
def _store_out(ptrs, value, mask, OUT_KIND: tl.constexpr):
    """Store fp32 `value` as fp32 (OUT_KIND 0) or bf16 rounded to nearest even (1, into an int16 view)."""
    if OUT_KIND == 1:
        bits = value.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(value != value, 0x7FC0, rounded & 0xFFFF)
        tl.store(ptrs, out.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, value, mask=mask)


@_jit
def _exp2(e):
    """2**e as exact fp32 for integer e in [-127, 127] (2**-127, bits 0x400000, is the one subnormal)."""
    bits = tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, 0x400000)
    return bits.to(tl.float32, bitcast=True)


@_jit
def _encode(x, MANT: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr, SIGN_BIT: tl.constexpr,
            NAN_CODE: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEPS: tl.constexpr):
    """fp32 -> minifloat code, round to nearest even, saturating; NaN -> NAN_CODE (sign kept).

    As `formats._encode_minifloat`: quantum 2**(max(E - 127, EMIN) - MANT)
    from the exponent bits of x. MIN_NORMAL = 2**EMIN, SUBNORMAL_STEPS =
    2**(MANT - EMIN) (the inverse of the smallest subnormal).
    """
    bits = x.to(tl.int32, bitcast=True)
    mag = tl.abs(x)
    quantum_bits = tl.maximum(bits & 0x7F800000, (127 + EMIN) << 23) - (MANT << 23)
    quantum = quantum_bits.to(tl.float32, bitcast=True)
    inv_quantum = ((254 << 23) - quantum_bits).to(tl.float32, bitcast=True)
    v = mag * inv_quantum
    rounded = ((v + 8388608.0) - 8388608.0) * quantum
    rounded = tl.minimum(tl.where(mag == mag, rounded, 0.0), MAX)  # NaN's code is set below
    normal_code = (rounded.to(tl.int32, bitcast=True) >> (23 - MANT)) - ((126 + EMIN) << MANT)
    subnormal_code = (rounded * SUBNORMAL_STEPS).to(tl.int32)
    code = tl.where(rounded >= MIN_NORMAL, normal_code, subnormal_code)
    code = tl.where(mag != mag, NAN_CODE, code)
    return code | ((bits >> 31) & (1 << SIGN_BIT))


@_jit
def _encode_e4m3(x):
    return _encode(x, 3, -6, 448.0, 7, 0x7F, 0.015625, 512.0)


@_jit
def _encode_e2m1(x):
    return _encode(x, 1, 0, 6.0, 3, 0x7, 1.0, 2.0)


@_jit
def _decode_e4m3(code):
    """int32 E4M3 code -> exact fp32 value (NaN for 0x7F/0xFF)."""
    field = (code >> 3) & 0xF
    mant = code & 0x7
    normal = (mant + 8).to(tl.float32) * ((field + 117) << 23).to(tl.float32, bitcast=True)
    mag = tl.where(field == 0, mant.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((code & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((code & 0x80) != 0, -mag, mag)


@_jit
def _decode_e2m1(code):
    """int32 E2M1 code (low nibble) -> exact fp32 value."""
    field = (code >> 1) & 0x3
    mant = code & 0x1
    normal = (mant + 2).to(tl.float32) * ((field + 125) << 23).to(tl.float32, bitcast=True)
    mag = tl.where(field == 0, mant.to(tl.float32) * 0.5, normal)
    return tl.where((code & 0x8) != 0, -mag, mag)


# ---------------------------------------------------------------- MXFP8
@_jit
def _mxfp8_quantize_kernel(x_ptr, data_ptr, scale_ptr, out_ptr, rows, nblocks,
                           IN_BF16: tl.constexpr, FAKE: tl.constexpr, OUT_KIND: tl.constexpr,
                           ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """x [rows, nblocks * 32] -> data uint8 + scale uint8 [rows, nblocks], or (FAKE) out = dequantized."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    mask = (r < rows) & (b < nblocks)
    offs = r.to(tl.int64) * (nblocks * 32) + b * 32 + j
    x = _load_fp32(x_ptr + offs, mask, IN_BF16)
    mag = tl.abs(x)
    bad = (mag != mag) | (mag == float("inf"))
    nonfinite = tl.reduce(bad.to(tl.int32), 2, _MAX, keep_dims=True) > 0  # [ROWS, BLOCKS, 1]
    amax_bits = tl.reduce(tl.where(bad, 0.0, mag), 2, _MAX, keep_dims=True).to(tl.int32, bitcast=True)
    # frexp(amax) = f * 2**p: p = E - 126 for a normal amax, and f > 0.875 iff the mantissa
    # field exceeds 0x600000. A zero or subnormal amax (field 0) gives e <= -134: clamped to -127,
    # as in the reference. e <= 120 for any finite amax, so 2**-e below is a normal number.
    field = amax_bits >> 23
    e = tl.maximum(tl.where((amax_bits & 0x7FFFFF) > 0x600000, field - 134, field - 135), -127)
    e = tl.where(nonfinite, 0, e)
    code = _encode_e4m3(x * ((127 - e) << 23).to(tl.float32, bitcast=True))  # x / 2**e, exact
    if FAKE:
        scale_value = tl.where(nonfinite, float("nan"), _exp2(e))
        _store_out(out_ptr + offs, _decode_e4m3(code) * scale_value, mask, OUT_KIND)
    else:
        tl.store(data_ptr + offs, code.to(tl.uint8), mask=mask)
        scale = tl.where(nonfinite, 0xFF, e + 127)
        tl.store(scale_ptr + r.to(tl.int64) * nblocks + b, scale.to(tl.uint8), mask=(r < rows) & (b < nblocks))


@_jit
def _mxfp8_dequantize_kernel(data_ptr, scale_ptr, out_ptr, rows, nblocks, OUT_KIND: tl.constexpr,
                             ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """data uint8 [rows, nblocks * 32], scale uint8 [rows, nblocks] -> out [rows, nblocks * 32]."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    mask = (r < rows) & (b < nblocks)
    offs = r.to(tl.int64) * (nblocks * 32) + b * 32 + j
    code = tl.load(data_ptr + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + r.to(tl.int64) * nblocks + b, mask=(r < rows) & (b < nblocks), other=0).to(tl.int32)
    scale_value = tl.where(s == 0xFF, float("nan"), _exp2(tl.minimum(s, 254) - 127))
    _store_out(out_ptr + offs, _decode_e4m3(code) * scale_value, mask, OUT_KIND)


# ---------------------------------------------------------------- NVFP4 (per token)
@_jit
def _max_over_tile(v):
    """[ROWS, BLOCKS, 8] -> [ROWS, 1, 1] max."""
    return tl.reduce(tl.reduce(v, 2, _MAX, keep_dims=True), 1, _MAX, keep_dims=True)


@_jit
def _nvfp4_quantize_kernel(x_ptr, data_ptr, block_scale_ptr, token_scale_ptr, out_ptr, rows, nblocks,
                           IN_BF16: tl.constexpr, FAKE: tl.constexpr, OUT_KIND: tl.constexpr,
                           ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """x [rows, nblocks * 16] -> data [rows, nblocks * 8], block_scale [rows, nblocks], token_scale [rows];
    or (FAKE) out = dequantized. Elements are handled as even/odd pairs: one byte each."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    j = tl.arange(0, 8)[None, None, :]
    row_mask = r < rows
    k = nblocks * 16
    # pass 1: the row amax over finite magnitudes, and whether the row holds inf/NaN
    amax = tl.full((ROWS, 1, 1), 0.0, tl.float32)
    any_bad = tl.full((ROWS, 1, 1), 0, tl.int32)
    for b0 in range(0, nblocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)[None, :, None]
        mask = row_mask & (b < nblocks)
        offs = r.to(tl.int64) * k + b * 16 + 2 * j
        for half in tl.static_range(2):
            mag = tl.abs(_load_fp32(x_ptr + offs + half, mask, IN_BF16))
            bad = (mag != mag) | (mag == float("inf"))
            any_bad = tl.maximum(any_bad, _max_over_tile(bad.to(tl.int32)))
            amax = tl.maximum(amax, _max_over_tile(tl.where(bad, 0.0, mag)))
    nonfinite = any_bad > 0
    token_scale = tl.math.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32))
    token_scale = tl.where(token_scale == 0, 1.0, token_scale)
    # NaN with the reference's bits (0x7FC00000), so token scales match bit for bit
    token_scale = tl.where(nonfinite, tl.full(amax.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True),
                           token_scale)  # [ROWS, 1, 1]
    if not FAKE:
        tl.store(token_scale_ptr + r, token_scale, mask=row_mask)
    six_ts = 6.0 * token_scale
    # pass 2: block scales and elements
    for b0 in range(0, nblocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)[None, :, None]
        mask = row_mask & (b < nblocks)
        offs = r.to(tl.int64) * k + b * 16 + 2 * j
        x_even = _load_fp32(x_ptr + offs, mask, IN_BF16)
        x_odd = _load_fp32(x_ptr + offs + 1, mask, IN_BF16)
        block_amax = tl.maximum(tl.reduce(tl.abs(x_even), 2, _MAX, keep_dims=True),
                                tl.reduce(tl.abs(x_odd), 2, _MAX, keep_dims=True))
        block_code = _encode_e4m3(tl.math.div_rn(block_amax, tl.broadcast_to(six_ts, block_amax.shape)))
        block_code = tl.where(nonfinite, 0x7F, block_code)  # [ROWS, BLOCKS, 1]
        denom = _decode_e4m3(block_code) * token_scale
        usable = (denom != 0) & (denom == denom)
        safe = tl.broadcast_to(tl.where(usable, denom, 1.0), x_even.shape)
        lo = tl.where(usable, _encode_e2m1(tl.math.div_rn(x_even, safe)), 0)
        hi = tl.where(usable, _encode_e2m1(tl.math.div_rn(x_odd, safe)), 0)
        if FAKE:
            block_value = _decode_e4m3(block_code)
            _store_out(out_ptr + offs, (_decode_e2m1(lo) * block_value) * token_scale, mask, OUT_KIND)
            _store_out(out_ptr + offs + 1, (_decode_e2m1(hi) * block_value) * token_scale, mask, OUT_KIND)
        else:
            tl.store(data_ptr + r.to(tl.int64) * (nblocks * 8) + b * 8 + j, (lo | (hi << 4)).to(tl.uint8),
                     mask=mask)
            tl.store(block_scale_ptr + r.to(tl.int64) * nblocks + b, block_code.to(tl.uint8),
                     mask=row_mask & (b < nblocks))


@_jit
def _nvfp4_dequantize_kernel(data_ptr, block_scale_ptr, token_scale_ptr, out_ptr, rows, nblocks,
                             OUT_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """data [rows, nblocks * 8], block_scale [rows, nblocks], token_scale [rows] -> out [rows, nblocks * 16]."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    mask = (r < rows) & (b < nblocks)
    packed = tl.load(data_ptr + r.to(tl.int64) * (nblocks * 8) + b * 8 + j, mask=mask, other=0).to(tl.int32)
    block_value = _decode_e4m3(tl.load(block_scale_ptr + r.to(tl.int64) * nblocks + b, mask=mask, other=0)
                               .to(tl.int32))
    token_scale = tl.load(token_scale_ptr + r, mask=r < rows, other=1.0)
    offs = r.to(tl.int64) * (nblocks * 16) + b * 16 + 2 * j
    _store_out(out_ptr + offs, (_decode_e2m1(packed & 0xF) * block_value) * token_scale, mask, OUT_KIND)
    _store_out(out_ptr + offs + 1, (_decode_e2m1(packed >> 4) * block_value) * token_scale, mask, OUT_KIND)


# ---------------------------------------------------------------- launchers
# Tiles of about 4096 elements per program on the GPU; the interpreter runs each program as numpy
# calls, so there fewer, bigger ones. A tile spans at most 64 blocks of a row and as many rows as fit.
_INTERPRETED = not torch.cuda.is_available()
_TILE_ELEMENTS = 1 << 16 if _INTERPRETED else 4096


def _tile(rows: int, nblocks: int, block: int) -> tuple[int, int]:
    """(ROWS, BLOCKS), powers of two, for a [rows, nblocks * block] input."""
    blocks = min(triton.next_power_of_2(max(nblocks, 1)), 64, _TILE_ELEMENTS // block)
    tile_rows = max(1, min(triton.next_power_of_2(max(rows, 1)), _TILE_ELEMENTS // (blocks * block)))
    return tile_rows, blocks


def _launch(kernel, grid, *args, **meta) -> None:
    """kernel[grid](*args, **meta); in the interpreter with numpy's overflow/NaN warnings off
    (inf and NaN are expected values here)."""
    if _INTERPRETED:
        import warnings

        import numpy as np

        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "All-NaN slice" in a max
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _leading(shape) -> int:
    return math.prod(shape[:-1])


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x [..., k] -> (contiguous [rows, k] in its own dtype, or bf16 viewed as int16; whether it is bf16)."""
    rows = x.reshape(_leading(x.shape), x.shape[-1]).contiguous()
    if rows.dtype == torch.bfloat16:
        return rows.view(torch.int16), True
    return rows, False


def _out_buffer(shape, dtype: torch.dtype, device) -> tuple[torch.Tensor, int]:
    """The kernel's output buffer for `dtype` (bf16 as int16) and its OUT_KIND."""
    kind = _OUT_DTYPES.get(dtype, 0)
    buffer = torch.empty(shape, dtype=torch.float32 if kind == 0 else torch.int16, device=device)
    return buffer, kind


def _finish(buffer: torch.Tensor, kind: int, dtype: torch.dtype, shape) -> torch.Tensor:
    out = buffer.view(torch.bfloat16) if kind == 1 else buffer
    return out.reshape(shape).to(dtype)


def _mxfp8(x: torch.Tensor, fake: bool, dtype: torch.dtype | None):
    rows, in_bf16 = _as_rows(x)
    n, nblocks = rows.shape[0], rows.shape[1] // MXFP8_BLOCK
    # the outputs the kernel does not write are empty (a null pointer it never touches)
    data = torch.empty((0,) if fake else rows.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty((0,) if fake else (n, nblocks), dtype=torch.uint8, device=x.device)
    out, kind = _out_buffer(rows.shape if fake else (0,), dtype or torch.float32, x.device)
    if rows.numel():
        tile_rows, tile_blocks = _tile(n, nblocks, MXFP8_BLOCK)
        grid = (triton.cdiv(n, tile_rows), triton.cdiv(nblocks, tile_blocks))
        _launch(_mxfp8_quantize_kernel, grid, rows, data, scale, out, n, nblocks, IN_BF16=in_bf16, FAKE=fake,
                OUT_KIND=kind, ROWS=tile_rows, BLOCKS=tile_blocks)
    if fake:
        return _finish(out, kind, dtype, x.shape)
    return MXFP8Tensor(data=data.reshape(x.shape), scale=scale.reshape(*x.shape[:-1], nblocks))


def quantize_mxfp8(x: torch.Tensor) -> MXFP8Tensor:
    """`formats.quantize_mxfp8` in one Triton kernel; same bits.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of 32.
    Returns:
        MXFP8Tensor, data [..., k] uint8, scale [..., k // 32] uint8.
    """
    check_quantizer_input(x, MXFP8_BLOCK, "quantize_mxfp8")
    return _mxfp8(x, fake=False, dtype=None)


def dequantize_mxfp8(q: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`formats.dequantize_mxfp8` in one Triton kernel; same values.

    Args:
        q: MXFP8Tensor, data [..., k] uint8, scale [..., k // 32] uint8.
        dtype: output dtype.
    Returns:
        [..., k] dtype.
    """
    k = q.data.shape[-1]
    if q.scale.shape != q.data.shape[:-1] + (k // MXFP8_BLOCK,) or k % MXFP8_BLOCK:
        raise ValueError(
            f"dequantize_mxfp8: scale shape {tuple(q.scale.shape)} does not match data shape "
            f"{tuple(q.data.shape)}; expected {tuple(q.data.shape[:-1]) + (k // MXFP8_BLOCK,)}"
        )
    n, nblocks = _leading(q.data.shape), k // MXFP8_BLOCK
    data = q.data.reshape(n, k).contiguous()
    scale = q.scale.reshape(n, nblocks).contiguous()
    out, kind = _out_buffer(data.shape, dtype, data.device)
    if data.numel():
        tile_rows, tile_blocks = _tile(n, nblocks, MXFP8_BLOCK)
        grid = (triton.cdiv(n, tile_rows), triton.cdiv(nblocks, tile_blocks))
        _launch(_mxfp8_dequantize_kernel, grid, data, scale, out, n, nblocks, OUT_KIND=kind,
                ROWS=tile_rows, BLOCKS=tile_blocks)
    return _finish(out, kind, dtype, q.data.shape)


def _nvfp4(x: torch.Tensor, fake: bool, dtype: torch.dtype | None):
    rows, in_bf16 = _as_rows(x)
    n, nblocks = rows.shape[0], rows.shape[1] // NVFP4_BLOCK
    data = torch.empty((0,) if fake else (n, nblocks * 8), dtype=torch.uint8, device=x.device)
    block_scale = torch.empty((0,) if fake else (n, nblocks), dtype=torch.uint8, device=x.device)
    token_scale = torch.ones((0,) if fake else n, dtype=torch.float32, device=x.device)  # a k = 0 row's is 1
    out, kind = _out_buffer(rows.shape if fake else (0,), dtype or torch.float32, x.device)
    if rows.numel():
        tile_rows, tile_blocks = _tile(n, nblocks, NVFP4_BLOCK)
        _launch(_nvfp4_quantize_kernel, (triton.cdiv(n, tile_rows),), rows, data, block_scale, token_scale, out, n,
                nblocks, IN_BF16=in_bf16, FAKE=fake, OUT_KIND=kind, ROWS=tile_rows, BLOCKS=tile_blocks)
    if fake:
        return _finish(out, kind, dtype, x.shape)
    lead = x.shape[:-1]
    return NVFP4Tensor(data=data.reshape(*lead, nblocks * 8), block_scale=block_scale.reshape(*lead, nblocks),
                       token_scale=token_scale.reshape(lead))


def quantize_nvfp4(x: torch.Tensor) -> NVFP4Tensor:
    """`formats.quantize_nvfp4` (per-token scale) in one Triton kernel; same bits.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of 16.
    Returns:
        NVFP4Tensor, data [..., k // 2], block_scale [..., k // 16] uint8, token_scale [...] float32.
    """
    check_quantizer_input(x, NVFP4_BLOCK, "quantize_nvfp4")
    return _nvfp4(x, fake=False, dtype=None)


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`formats.dequantize_nvfp4` in one Triton kernel; same values.

    Args:
        q: NVFP4Tensor, data [..., k // 2], block_scale [..., k // 16] uint8, token_scale [...] float32.
        dtype: output dtype.
    Returns:
        [..., k] dtype.
    """
    k = q.data.shape[-1] * 2
    if q.block_scale.shape != q.data.shape[:-1] + (k // NVFP4_BLOCK,) or q.token_scale.shape != q.data.shape[:-1] \
            or k % NVFP4_BLOCK:
        raise ValueError(
            f"dequantize_nvfp4: block_scale {tuple(q.block_scale.shape)} / token_scale "
            f"{tuple(q.token_scale.shape)} do not match data {tuple(q.data.shape)}; expected "
            f"{tuple(q.data.shape[:-1]) + (k // NVFP4_BLOCK,)} and {tuple(q.data.shape[:-1])}"
        )
    n, nblocks = _leading(q.data.shape), k // NVFP4_BLOCK
    data = q.data.reshape(n, k // 2).contiguous()
    block_scale = q.block_scale.reshape(n, nblocks).contiguous()
    token_scale = q.token_scale.reshape(n).float().contiguous()
    out, kind = _out_buffer((n, k), dtype, data.device)
    if out.numel():
        tile_rows, tile_blocks = _tile(n, nblocks, NVFP4_BLOCK)
        grid = (triton.cdiv(n, tile_rows), triton.cdiv(nblocks, tile_blocks))
        _launch(_nvfp4_dequantize_kernel, grid, data, block_scale, token_scale, out, n, nblocks, OUT_KIND=kind,
                ROWS=tile_rows, BLOCKS=tile_blocks)
    return _finish(out, kind, dtype, (*q.data.shape[:-1], k))


def fake_quantize(x: torch.Tensor, fmt: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) in one kernel, for fmt "mxfp8" or "nvfp4" (per token); same values.

    Args:
        x: [..., k] float32/bfloat16/float16, k a multiple of the format's block.
        fmt: "mxfp8" or "nvfp4".
        dtype: output dtype; None keeps x.dtype.
    Returns:
        [..., k] dtype.
    """
    dtype = x.dtype if dtype is None else dtype
    if fmt == "mxfp8":
        check_quantizer_input(x, MXFP8_BLOCK, "quantize_mxfp8")
        return _mxfp8(x, fake=True, dtype=dtype)
    if fmt == "nvfp4":
        check_quantizer_input(x, NVFP4_BLOCK, "quantize_nvfp4")
        return _nvfp4(x, fake=True, dtype=dtype)
    raise ValueError(f"triton fake_quantize: format {fmt!r} has no kernel; use 'mxfp8' or 'nvfp4' "
                     f"(formats.fake_quantize for 'nvfp4_per_tensor')")
