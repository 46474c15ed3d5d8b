"""Triton quantizers against the torch reference (`quant/formats.py`), bit for bit; the weight cache.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (small
inputs: it is slow); the `gpu` tests run them compiled on 1e7 values and
check that the quantized experts never sync with the host.
"""
import math

import pytest
import torch

from megatron_composer.quant import formats
from megatron_composer.quant.formats import E4M3_MAX, MXFP8Tensor, NVFP4Tensor

pytest.importorskip("triton")
from megatron_composer.quant import ops, triton_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = 64  # two MXFP8 blocks, four NVFP4 blocks per row


def _e4m3_values() -> torch.Tensor:
    """The 126 positive finite nonzero E4M3 values, ascending (from torch's own float8 type)."""
    return torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _rows(values: torch.Tensor, lead: float, per_row: int) -> torch.Tensor:
    """Rows of K: every `per_row`-th slot holds `lead` (pinning the block amax), the rest `values` (zero-padded)."""
    fill = K - K // per_row
    n = math.ceil(values.numel() / fill)
    body = torch.zeros(n * fill)
    body[: values.numel()] = values
    rows = torch.full((n, K), lead)
    free = torch.ones(K, dtype=torch.bool)
    free[::per_row] = False
    rows[:, free] = body.reshape(n, fill)
    return rows


def _ties(grid: torch.Tensor) -> torch.Tensor:
    """Every grid value, every midpoint of neighbours and the fp32 neighbours of each midpoint, both signs."""
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e30))])
    return torch.cat([pts, -pts])


def adversarial(seed: int = 0) -> torch.Tensor:
    """[rows, K] float32 of values at the formats' edges (see the module docstring of formats.py)."""
    g = torch.Generator().manual_seed(seed)
    e4m3 = _e4m3_values()
    parts = []
    # E4M3 ties and values, unscaled (block amax 448) and scaled by powers of two, subnormal results included
    ties = _ties(torch.cat([torch.zeros(1), e4m3]))
    for k in (-140, -127, -60, -7, -1, 0, 1, 9, 60, 119):
        parts.append(_rows(ties, E4M3_MAX, 32) * 2.0 ** k)
    # block amax just above 448 * 2**k, and E4M3 ties in the block scale of NVFP4 rows with token scale 1
    for k in (-126, 0, 1, 100):
        parts.append(_rows(ties * 2.0 ** k, float(torch.nextafter(torch.tensor(E4M3_MAX), torch.tensor(1e30))) * 2.0 ** k, 32))
    block_scale_ties = _ties(torch.cat([torch.zeros(1), e4m3]))[: 3 * 126].abs()
    for scale_rows in (block_scale_ties * 6).split(3):  # one block amax per NVFP4 block after the first
        row = torch.zeros(K)
        row[0] = 2688.0  # token scale exactly 1
        row[16::16] = scale_rows[:3]
        parts.append(row[None])
    # E2M1 ties inside blocks whose scale is an exact E4M3 value v (token scale 2**k)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    e2m1_ties = _ties(e2m1).split(15)
    for v in (float(e4m3[0]), float(e4m3[9]), 1.0, 1.125, 13.0, 448.0):
        for i in range(0, len(e2m1_ties), 3):
            row = torch.zeros(K)
            row[0] = 2688.0
            for b, chunk in enumerate(e2m1_ties[i: i + 3], start=1):
                row[16 * b: 16 * b + chunk.numel()] = v * chunk
                row[16 * b + 15] = 6.0 * v
            for k in (-100, 0, 50):
                parts.append(row[None] * 2.0 ** k)
    # block amax an exact power of two, every exponent
    exps = torch.arange(-149, 128, dtype=torch.float64)
    u = torch.rand(exps.numel(), 32, generator=g) * 2 - 1
    pow2 = torch.cat([(2.0 ** exps).float()[:, None], (u[:, 1:] * (2.0 ** exps)[:, None]).float()], dim=1)
    parts.append(pow2[: pow2.shape[0] // 2 * 2].reshape(-1, K))
    # zeros: an all-zero row, a row of -0.0, zero blocks beside non-zero ones, signed zeros mixed
    parts.append(torch.zeros(1, K))
    parts.append(torch.full((1, K), -0.0))
    mixed = torch.randn(2, K, generator=g)
    mixed[0, :32] = 0.0
    mixed[1, ::3] = -0.0
    parts.append(mixed)
    # fp32 subnormals, alone and with a tiny normal amax (block scale 2**-127, non-zero codes)
    sub = (torch.randint(1, 1 << 23, (4, K), generator=g, dtype=torch.int32)).view(torch.float32)
    sub[2:, ::7] = 2.0 ** -126
    parts.append(sub * torch.where(torch.rand(4, K, generator=g) < 0.5, -1.0, 1.0))
    # non-finite: +-inf and NaN (both signs, a payload) in single blocks and whole rows
    nan_neg = torch.tensor([-1], dtype=torch.int32).view(torch.float32)  # 0xFFFFFFFF, a negative NaN
    specials = torch.randn(8, K, generator=g)
    for i, bad in enumerate((float("inf"), -float("inf"), float("nan"), float(nan_neg))):
        specials[2 * i, 5] = bad
        specials[2 * i + 1, 40] = bad
        specials[2 * i + 1, 41] = -bad
    parts.append(specials)
    parts.append(torch.tensor([float("inf"), float("nan"), 3.4e38, -3.4e38] * (K // 4))[None])
    return torch.cat(parts)


def random_values(n: int, seed: int) -> torch.Tensor:
    """[n // K, K] float32: a third random bit patterns (NaN, inf, subnormals included), a third random
    finite exponents, a third Gaussians with log-normal row scales."""
    g = torch.Generator().manual_seed(seed)
    rows = n // K
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows // 3, K), generator=g, dtype=torch.int32).view(torch.float32)
    exponent = torch.randint(0, 255, (rows // 3, K), generator=g, dtype=torch.int32)
    mant = torch.randint(0, 1 << 23, (rows // 3, K), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (rows // 3, K), generator=g, dtype=torch.int32) << 31
    finite = (sign | (exponent << 23) | mant).view(torch.float32)
    rest = rows - 2 * (rows // 3)
    gauss = torch.randn(rest, K, generator=g) * torch.exp(torch.randn(rest, 1, generator=g) * 4)
    return torch.cat([bits, finite, gauss])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Identical bits except that any NaN equals any NaN (a NaN's payload is no part of the formats)."""
    a, b = a.cpu(), b.cpu()
    nan = torch.isnan(a)
    return a.dtype == b.dtype and torch.equal(nan, torch.isnan(b)) and torch.equal(
        _bits(torch.where(nan, 0, a)), _bits(torch.where(nan, 0, b)))


def _check_quantize(x: torch.Tensor) -> None:
    for kernel, reference in ((triton_kernels.quantize_mxfp8, formats.quantize_mxfp8),
                              (triton_kernels.quantize_nvfp4, formats.quantize_nvfp4)):
        got, want = kernel(x), reference(x)
        for field in want.__dataclass_fields__:
            assert _same_bits(getattr(got, field), getattr(want, field)), (kernel.__name__, field, x.dtype)
    for fmt in ("mxfp8", "nvfp4"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = triton_kernels.fake_quantize(x, fmt, dtype)
            assert _same_values(got, formats.fake_quantize(x, fmt, dtype)), (fmt, x.dtype, dtype)


# ------------------------------------------------------------------ bit-exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_equal_reference_on_adversarial_values(dtype):
    x = adversarial().to(dtype).to(DEVICE)
    assert x.shape[0] > 200
    _check_quantize(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_reference_on_random_values(dtype):
    _check_quantize(random_values(1 << 16, seed=1).to(dtype).to(DEVICE))


def test_kernels_keep_leading_dims_odd_rows_and_empty_inputs():
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE)  # partial tiles
    _check_quantize(x)
    _check_quantize(x.transpose(0, 1))  # non-contiguous
    for shape in ((0, 64), (3, 0)):
        empty = torch.zeros(shape, device=DEVICE)
        for kernel, reference in ((triton_kernels.quantize_mxfp8, formats.quantize_mxfp8),
                                  (triton_kernels.quantize_nvfp4, formats.quantize_nvfp4)):
            got, want = kernel(empty), reference(empty)
            for field in want.__dataclass_fields__:
                assert _same_bits(getattr(got, field), getattr(want, field)), (shape, field)
    with pytest.raises(ValueError, match="last dimension 40 is not a multiple of the block size 32"):
        triton_kernels.quantize_mxfp8(torch.zeros(2, 40, device=DEVICE))
    with pytest.raises(TypeError, match="float64"):
        triton_kernels.quantize_nvfp4(torch.zeros(2, 32, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_kernels_equal_reference_on_every_code(dtype):
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (64, K), generator=g, dtype=torch.uint8)
    data[0, :] = torch.arange(K, dtype=torch.uint8)
    data[1, :] = torch.arange(K, 2 * K, dtype=torch.uint8)
    data[2:4, :] = torch.arange(2 * K, 4 * K, dtype=torch.uint8).reshape(2, K)
    scale = torch.randint(0, 256, (64, K // 32), generator=g, dtype=torch.uint8)
    scale[:4] = torch.tensor([0, 1, 127, 255, 254, 200, 60, 0], dtype=torch.uint8).reshape(4, 2)
    q = MXFP8Tensor(data.to(DEVICE), scale.to(DEVICE))
    assert _same_values(triton_kernels.dequantize_mxfp8(q, dtype), formats.dequantize_mxfp8(q, dtype))
    block_scale = torch.randint(0, 256, (64, K // 16), generator=g, dtype=torch.uint8)
    token_scale = torch.exp(torch.randn(64, generator=g) * 20)
    token_scale[:6] = torch.tensor([float("nan"), float("inf"), 1e-40, 0.0, 3e38, 1.0])
    n = NVFP4Tensor(data[:, : K // 2].contiguous().to(DEVICE), block_scale.to(DEVICE), token_scale.to(DEVICE))
    assert _same_values(triton_kernels.dequantize_nvfp4(n, dtype), formats.dequantize_nvfp4(n, dtype))


def test_ops_route_cuda_to_kernels_and_cpu_to_reference(monkeypatch):
    calls = []
    for name in ("quantize_mxfp8", "quantize_nvfp4", "fake_quantize", "dequantize_mxfp8", "dequantize_nvfp4"):
        original = getattr(triton_kernels, name)
        monkeypatch.setattr(triton_kernels, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    x = torch.randn(4, 64)
    ops.dequantize(ops.quantize(x, "mxfp8")), ops.fake_quantize(x, "nvfp4")
    assert calls == [] and ops.TRITON_DEVICES == {"cuda"}  # CPU tensors: the reference
    monkeypatch.setattr(ops, "TRITON_DEVICES", {DEVICE})
    x = x.to(DEVICE)
    assert _same_values(ops.fake_quantize(x, "nvfp4_per_tensor"), formats.fake_quantize(x, "nvfp4_per_tensor"))
    ops.dequantize(ops.quantize(x, "mxfp8")), ops.dequantize(ops.quantize(x, "nvfp4")), ops.fake_quantize(x, "mxfp8")
    assert calls == ["quantize_mxfp8", "dequantize_mxfp8", "quantize_nvfp4", "dequantize_nvfp4", "fake_quantize"]


def test_quantized_linear_through_kernels_equals_reference_path(monkeypatch):
    """The GEMM's quantizers see transposed, padded and bf16 operands and a cached weight;
    through the kernels every bit of y, dx and dw stays."""
    from megatron_composer.quant import WeightQuantCache, quantized_linear

    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 64, generator=g).bfloat16().to(DEVICE).requires_grad_()
    w = (torch.randn(96, 64, generator=g) * 0.1).to(DEVICE).requires_grad_()
    dy = torch.randn(37, 96, generator=g).bfloat16().to(DEVICE)

    def run(precision, cached):
        y = quantized_linear(x, w, precision, cached=WeightQuantCache().get(w) if cached else None)
        return (y, *torch.autograd.grad(y, [x, w], dy))

    for precision in ("nvfp4", "mxfp8"):
        monkeypatch.setattr(ops, "TRITON_DEVICES", set())
        reference = run(precision, cached=False)
        monkeypatch.setattr(ops, "TRITON_DEVICES", {DEVICE})
        for cached in (False, True):
            for got, want in zip(run(precision, cached), reference):
                assert _same_bits(got, want), (precision, cached)


# ------------------------------------------------------------------ on CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernels_equal_reference_on_1e7_values(dtype):
    """Compiled kernels vs the reference, both on CUDA: adversarial values, 1e7 random values in rows
    of 64 and 1e7 in rows of 7168 (the NVFP4 kernel's loop over a row)."""
    _check_quantize(adversarial().to(dtype).cuda())
    values = random_values(1396 * 7168, seed=7)  # 1.0e7 values
    _check_quantize(values.to(dtype).cuda())
    _check_quantize(values.flatten()[: 1396 * 7168].reshape(1396, 7168).to(dtype).cuda())


@pytest.mark.gpu
def test_cuda_dequantize_kernels_equal_reference():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        test_dequantize_kernels_equal_reference_on_every_code(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [True, False], ids=["triton", "reference"])
def test_quantized_experts_and_dispatch_never_sync_with_the_host(monkeypatch, kernels):
    """Forward and backward of the NVFP4 experts (MXFP8 backward) and the MXFP8 dispatch's
    quantize/dequantize, on CUDA under torch's sync debug mode "error"."""
    from tests.test_quant_moe import _experts, _permuted_tokens

    if not kernels:
        monkeypatch.setattr(ops, "TRITON_DEVICES", set())
    _, experts = _experts("nvfp4", torch.bfloat16)
    experts = experts.cuda()
    x, counts, probs = _permuted_tokens(torch.bfloat16)  # tokens_per_expert stays on the CPU, as megatron has it
    x, probs = x.detach().cuda().requires_grad_(), probs.detach().cuda().requires_grad_()

    def step():
        out, _ = experts(x, counts, probs)
        out.backward(torch.ones_like(out))
        q = ops.quantize_mxfp8(x)
        return ops.dequantize_mxfp8(q, x.dtype)

    step()  # compiles the kernels and builds the decode tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        from megatron_composer.quant import invalidate_quantized_weights

        invalidate_quantized_weights()
        step()  # the weights quantized again
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in experts.parameters())


_COMPILE_FOR_HOPPER = r'''
import torch
torch.cuda.is_available = lambda: True  # build the compiled kernels, not the interpreter's
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_composer.quant import triton_kernels as tk

def ptx(fn, pointers, **constexprs):
    sig = dict(pointers, rows="i32", nblocks="i32", **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

quant = dict(IN_BF16=True, ROWS=4, BLOCKS=64)
codes = [
    ptx(tk._mxfp8_quantize_kernel, dict(x_ptr="*i16", data_ptr="*u8", scale_ptr="*u8", out_ptr="*fp32"),
        FAKE=False, OUT_KIND=0, **quant),
    ptx(tk._mxfp8_quantize_kernel, dict(x_ptr="*i16", data_ptr="*u8", scale_ptr="*u8", out_ptr="*i16"),
        FAKE=True, OUT_KIND=1, **quant),
    ptx(tk._nvfp4_quantize_kernel, dict(x_ptr="*i16", data_ptr="*u8", block_scale_ptr="*u8", token_scale_ptr="*fp32",
                                        out_ptr="*fp32"), FAKE=False, OUT_KIND=0, **quant),
    ptx(tk._nvfp4_quantize_kernel, dict(x_ptr="*i16", data_ptr="*u8", block_scale_ptr="*u8", token_scale_ptr="*fp32",
                                        out_ptr="*fp32"), FAKE=True, OUT_KIND=0, **quant),
    ptx(tk._mxfp8_dequantize_kernel, dict(data_ptr="*u8", scale_ptr="*u8", out_ptr="*i16"), OUT_KIND=1, ROWS=4, BLOCKS=64),
    ptx(tk._nvfp4_dequantize_kernel, dict(data_ptr="*u8", block_scale_ptr="*u8", token_scale_ptr="*fp32",
                                          out_ptr="*fp32"), OUT_KIND=0, ROWS=4, BLOCKS=64),
]
assert not any(".ftz" in c for c in codes), "a kernel flushes fp32 subnormals"
assert not any(op in c for c in codes for op in ("div.full", "div.approx")), "an approximate division"
assert all("div.rn.f32" in c for c in codes[2:4]), "the NVFP4 scales need IEEE division"
print("compiled", len(codes))
'''


def test_kernels_compile_for_hopper_without_ftz_or_approximate_division():
    """Triton compiles the kernels for sm_90 ahead of time (no GPU needed); the PTX keeps fp32
    subnormals (no .ftz) and divides with IEEE rounding, which bit-exactness relies on."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled 6" in result.stdout
