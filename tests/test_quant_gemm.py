"""Quantized expert GEMM: forward/backward emulation, error bound, causality.

The hand-computed references below build each GEMM from the format functions
(checked bit-exactly in test_quant_formats.py) and plain matmuls, with their
own transposes and zero padding.
"""
import pytest
import torch

from megatron_composer.quant import (
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_nvfp4_per_tensor,
    quantized_linear,
)


def operands(tokens=50, d_in=64, d_out=96, seed=0, dtype=torch.float32):
    """x [tokens, in], w [out, in], dy [tokens, out]; rows and columns get different
    power-of-two magnitudes, so blocking along the wrong dimension changes the scales."""
    g = torch.Generator().manual_seed(seed)

    def varied(rows, cols, base):
        mag = torch.randint(-4, 4, (rows, 1), generator=g) + torch.randint(-4, 4, (1, cols), generator=g)
        return (torch.randn(rows, cols, generator=g) * base * torch.exp2(mag.float())).to(dtype)

    return varied(tokens, d_in, 1.0), varied(d_out, d_in, 1 / 8), varied(tokens, d_out, 1.0)


def run(x, w, dy, precision):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = quantized_linear(x, w, precision)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def mx(t):
    """MXFP8 fake quantization along the last dim, fp32."""
    return dequantize_mxfp8(quantize_mxfp8(t))


def mx_along_tokens(t):
    """[tokens, n] -> its transpose [n, tokens] MXFP8-quantized along tokens, zero-padded by hand."""
    tokens = t.shape[0]
    pad = (-tokens) % 32
    padded = torch.cat([t.t().float(), torch.zeros(t.shape[1], pad)], dim=1)
    return mx(padded)[:, :tokens]


@pytest.mark.parametrize("tokens", [64, 50, 7])
def test_backward_equals_hand_computed_mxfp8(tokens):
    x, w, dy = operands(tokens=tokens)
    for precision in ("mxfp8", "nvfp4", "nvfp4_per_tensor"):
        _, dx, dw = run(x, w, dy, precision)
        assert torch.equal(dx, mx(dy) @ mx(w.t().contiguous()).t())
        assert torch.equal(dw, mx_along_tokens(dy) @ mx_along_tokens(x).t())


def test_forward_equals_hand_computed_quantized_matmul():
    x, w, _ = operands()
    y, _, _ = run(x, w, torch.zeros(50, 96), "nvfp4")
    assert torch.equal(y, dequantize_nvfp4(quantize_nvfp4(x)) @ dequantize_nvfp4(quantize_nvfp4(w)).t())
    y, _, _ = run(x, w, torch.zeros(50, 96), "nvfp4_per_tensor")
    per_tensor = dequantize_nvfp4(quantize_nvfp4_per_tensor(x)) @ dequantize_nvfp4(quantize_nvfp4_per_tensor(w)).t()
    assert torch.equal(y, per_tensor)
    y, _, _ = run(x, w, torch.zeros(50, 96), "mxfp8")
    assert torch.equal(y, mx(x) @ mx(w).t())
    y, _, _ = run(x, w, torch.zeros(50, 96), "bf16")
    assert torch.equal(y, x @ w.t())


def mxfp8_error(t):
    """Per-element bound on |mx(t) - t| for t blocked along its last dim (fp64).

    A block's scale 2**e satisfies amax > 224 * 2**e, E4M3 normals carry a
    relative error of at most 2**-4 and subnormals an absolute error of at
    most 2**-10 * 2**e.
    """
    t = t.double()
    amax = t.abs().reshape(*t.shape[:-1], -1, 32).amax(-1).repeat_interleave(32, dim=-1)
    return 2.0**-4 * t.abs() + 2.0**-10 * amax / 224


def product_bound(a, b):
    """Bound on |mx(a) @ mx(b).T - a @ b.T| for a [m, k], b [n, k] both blocked along k."""
    ea, eb = mxfp8_error(a), mxfp8_error(b)
    a, b = a.double().abs(), b.double().abs()
    return a @ eb.t() + ea @ b.t() + ea @ eb.t() + 1e-5 * (a @ b.t())  # last term: fp32 accumulation


def test_gradients_are_within_the_mxfp8_error_bound_of_fp32():
    x, w, dy = operands(tokens=64)
    _, dx, dw = run(x, w, dy, "nvfp4")
    dx_ref, dw_ref = (dy.double() @ w.double()), (dy.double().t() @ x.double())
    bound_dx = product_bound(dy, w.t())
    bound_dw = product_bound(dy.t(), x.t())
    assert ((dx.double() - dx_ref).abs() <= bound_dx).all()
    assert ((dw.double() - dw_ref).abs() <= bound_dw).all()
    # and the bound is not vacuous: the error is a few percent, as MXFP8's 3 mantissa bits give
    assert (dx.double() - dx_ref).norm() / dx_ref.norm() < 0.05
    assert (dw.double() - dw_ref).norm() / dw_ref.norm() < 0.05
    assert (dx.double() - dx_ref).abs().max() > 0


def test_zero_token_padding_is_exact_in_the_wgrad():
    x, w, dy = operands(tokens=40)
    _, _, dw = run(x, w, dy, "mxfp8")
    x64, dy64 = torch.cat([x, torch.zeros(24, 64)]), torch.cat([dy, torch.zeros(24, 96)])
    _, _, dw64 = run(x64, w, dy64, "mxfp8")
    torch.testing.assert_close(dw, dw64, rtol=1e-6, atol=1e-6)


def outlier_batches(t, seed):
    """Two batches equal in tokens <= t; the second has different later tokens, one a 1e6x outlier."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(48, 64, generator=g)
    b = a.clone()
    b[t + 1:] = torch.randn(47 - t, 64, generator=g)
    b[t + 3] *= 1e6
    return a, b


def loss_grads(x, w, target, precision):
    """Forward, loss = ||y - target||^2, backward; returns y and dL/dx."""
    x = x.clone().requires_grad_(True)
    y = quantized_linear(x, w, precision)
    ((y - target) ** 2).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("precision,causal", [("nvfp4", True), ("mxfp8", True), ("nvfp4_per_tensor", False)])
def test_causality_holds_per_token_and_fails_per_tensor(precision, causal):
    t = 10
    a, b = outlier_batches(t, seed=1)
    _, w, _ = operands(tokens=48)
    target = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    ya, ga = loss_grads(a, w, target, precision)
    yb, gb = loss_grads(b, w, target, precision)
    assert torch.equal(ya[: t + 1], yb[: t + 1]) is causal
    assert torch.equal(ga[: t + 1], gb[: t + 1]) is causal
    if not causal:  # the later outlier visibly degrades the earlier tokens
        exact = a[: t + 1] @ w.t()
        err_a = (ya[: t + 1] - exact).norm() / exact.norm()
        err_b = (yb[: t + 1] - exact).norm() / exact.norm()
        assert err_b > 2 * err_a


def test_batch_invariance_per_token_and_not_per_tensor():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g)
    _, w, _ = operands(tokens=32)
    other = torch.randn(32, 64, generator=g)
    other[0] *= 1e5  # an outlier token *before* token 5
    other[5] = x[5]
    for precision, invariant in (("nvfp4", True), ("nvfp4_per_tensor", False)):
        y1, y2 = quantized_linear(x, w, precision), quantized_linear(other, w, precision)
        assert torch.equal(y1[5], y2[5]) is invariant


def test_dtype_is_preserved_and_leading_dims_are_tokens():
    x, w, dy = operands(tokens=12, dtype=torch.bfloat16)
    x3 = x.reshape(3, 4, 64)
    for precision in ("bf16", "mxfp8", "nvfp4"):
        xr = x3.clone().requires_grad_(True)
        wr = w.float().clone().requires_grad_(True)  # fp32 master weight
        y = quantized_linear(xr, wr, precision)
        assert y.dtype == torch.bfloat16 and y.shape == (3, 4, 96)
        y.backward(dy.reshape(3, 4, 96))
        assert xr.grad.dtype == torch.bfloat16 and wr.grad.dtype == torch.float32
        flat = quantized_linear(x, w.float(), precision)
        assert torch.equal(y.reshape(12, 96), flat)


def test_empty_token_batch():
    x, w, _ = operands(tokens=0)
    for precision in ("mxfp8", "nvfp4"):
        y, dx, dw = run(x, w, torch.zeros(0, 96), precision)
        assert y.shape == (0, 96) and dx.shape == (0, 64) and torch.equal(dw, torch.zeros(96, 64))


def test_quantized_forward_is_close_to_bf16_reference():
    x, w, _ = operands(tokens=64)
    exact = x @ w.t()
    for precision, tol in (("mxfp8", 0.05), ("nvfp4", 0.2)):
        y = quantized_linear(x, w, precision)
        assert (y - exact).norm() / exact.norm() < tol


def test_shape_errors_name_the_value_and_fix():
    x, w, _ = operands(tokens=4, d_in=40, d_out=96)
    with pytest.raises(ValueError, match=r"in_features 40 .* nvfp4 block 16; pad .* 48"):
        quantized_linear(x, w, "nvfp4")
    x, w, _ = operands(tokens=4, d_in=64, d_out=80)
    with pytest.raises(ValueError, match=r"out_features 80 .* 96"):
        quantized_linear(x, w, "mxfp8")
    with pytest.raises(ValueError, match="fp8_e5m2"):
        quantized_linear(x, w, "fp8_e5m2")
    with pytest.raises(ValueError, match=r"in_features 64"):
        quantized_linear(torch.randn(4, 32), w, "nvfp4")
    assert quantized_linear(torch.randn(4, 40), torch.randn(80, 40), "bf16").shape == (4, 80)


def nan_at(shape, *where):
    """A bool mask of `shape` that is True on the given index expressions."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for index in where:
        mask[index] = True
    return mask


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_operand_poisons_exactly_what_it_feeds(precision, bad):
    """A non-finite x[3, 5] reaches y's token 3 and dw's input column 5, nothing else;
    a non-finite w[7, 9] reaches y's output 7 and dx's input column 9; a non-finite
    dy[4, 11] reaches dx's token 4 and dw's output row 11. No exception on the way."""
    x, w, dy = operands(tokens=50)
    cases = (
        ((3, 5), None, None, nan_at((50, 96), 3), nan_at((50, 64)), nan_at((96, 64), (slice(None), 5))),
        (None, (7, 9), None, nan_at((50, 96), (slice(None), 7)), nan_at((50, 64), (slice(None), 9)),
         nan_at((96, 64))),
        (None, None, (4, 11), nan_at((50, 96)), nan_at((50, 64), 4), nan_at((96, 64), 11)),
    )
    for at_x, at_w, at_dy, y_bad, dx_bad, dw_bad in cases:
        xb, wb, dyb = x.clone(), w.clone(), dy.clone()
        for t, at in ((xb, at_x), (wb, at_w), (dyb, at_dy)):
            if at is not None:
                t[at] = bad
        y, dx, dw = run(xb, wb, dyb, precision)
        for out, expected in ((y, y_bad), (dx, dx_bad), (dw, dw_bad)):
            assert torch.equal(~torch.isfinite(out), expected)


@pytest.mark.gpu
def test_cuda_matches_cpu_emulation():
    x, w, dy = operands(tokens=50)
    for precision in ("mxfp8", "nvfp4"):
        cpu = run(x, w, dy, precision)
        gpu = run(x.cuda(), w.cuda(), dy.cuda(), precision)
        for c, g in zip(cpu, gpu):
            torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-5)
