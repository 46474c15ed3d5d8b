"""MXFP8 / NVFP4 quantizers against independent references.

References, none of which calls the code under test:
  * E4M3 values come from torch's own `float8_e4m3fn` (decode of every bit
    pattern) and its RNE cast; E2M1 values from the format's value list.
  * `brute_force_rne` finds, for every input, the nearest value in that table
    by exhaustive search, ties to the even code, and saturates because the
    table ends at the maximum.
  * The block recipes are recomputed in numpy float64; each fp32 operation of
    the recipe is a float64 operation rounded to float32, which is the
    correctly rounded fp32 result (53 >= 2 * 24 + 2 bits, so the double
    rounding is innocuous).
"""
import numpy as np
import pytest
import torch

from megatron_composer.quant import (
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

# Non-negative finite values by code: E4M3 from torch's decoder (codes 0..0x7E),
# E2M1 from the format's definition (codes 0..7).
E4M3_MAGS = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def f32(a):
    """Round float64 values to float32 (RNE), returned as float64."""
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def brute_force_rne(values, mags, sign_bit):
    """Nearest table value by exhaustive search, ties to the even code; sign copied."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    codes = np.empty(v.shape, dtype=np.int64)
    idx = np.arange(len(mags))
    for start in range(0, len(v), 4096):
        # Beyond the maximum the nearest value is the maximum; capping keeps float64 distances exact.
        a = np.minimum(np.abs(v[start:start + 4096]), 2 * mags[-1])[:, None]
        d = np.abs(mags[None, :] - a)
        cand = d == d.min(axis=1, keepdims=True)
        even = cand & (idx % 2 == 0)
        codes[start:start + 4096] = np.where(even.any(1), even.argmax(1), cand.argmax(1))
    codes |= np.signbit(v).astype(np.int64) << sign_bit
    return codes.astype(np.uint8).reshape(np.shape(values))


def ref_mxfp8(x):
    """Reference MXFP8 of fp32 x [rows, k]: (data codes [rows, k], scale bits [rows, k/32])."""
    blocks = x.double().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    e = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 448.0)).astype(np.int64)
    e = np.where(amax > np.ldexp(448.0, e), e + 1, e)  # make it the smallest integer exactly
    e = np.where(amax <= np.ldexp(448.0, e - 1), e - 1, e)
    e = np.clip(np.where(amax == 0, -127, e), -127, 127)
    scaled = f32(blocks / np.ldexp(1.0, e)[..., None])
    return brute_force_rne(scaled, E4M3_MAGS, 7).reshape(x.shape), (e + 127).astype(np.uint8)


def ref_nvfp4(x, per_tensor=False):
    """Reference NVFP4 of fp32 x [rows, k]: (codes [rows, k], block scale bits, token scale)."""
    xs = x.double().numpy()
    amax = np.abs(xs).max() * np.ones(xs.shape[0]) if per_tensor else np.abs(xs).max(1)
    ts = f32(amax / 2688.0)
    ts = np.where(ts == 0, 1.0, ts)
    blocks = xs.reshape(xs.shape[0], -1, 16)
    bs_bits = brute_force_rne(f32(np.abs(blocks).max(-1) / f32(6.0 * ts)[:, None]), E4M3_MAGS, 7)
    denom = f32(E4M3_MAGS[bs_bits] * ts[:, None])
    scaled = f32(blocks / np.where(denom == 0, 1.0, denom)[..., None])
    codes = np.where(denom[..., None] == 0, 0, brute_force_rne(scaled, E2M1_MAGS, 3))
    return codes.reshape(xs.shape).astype(np.uint8), bs_bits, ts.astype(np.float32)


def unpack(data):
    """[..., k/2] packed bytes -> [..., k] codes, element 2j from the low nibble."""
    d = data.numpy()
    out = np.empty(d.shape[:-1] + (2 * d.shape[-1],), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = d & 0xF, d >> 4
    return out


def e4m3_midpoints():
    mags = E4M3_MAGS
    return (mags[1:] + mags[:-1]) / 2


def wide_random(n, seed, lo=-30, hi=10):
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(n, generator=g)
    return mant * torch.exp2(torch.randint(lo, hi, (n,), generator=g).float())


def varied_rows(rows, k, block, seed):
    """Rows whose blocks span many magnitudes, with signs, zeros, -0.0 and outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    block_exp = torch.randint(-24, 6, (rows, k // block), generator=g).float()
    x = x * torch.exp2(block_exp).repeat_interleave(block, dim=1)
    x[0, :] = 0.0  # all-zero row
    x[1, :block] = -0.0  # a block of negative zeros
    x[2, 5] = 1e4  # one outlier
    x[3] = torch.randn(k, generator=g) * 1e-41  # fp32 subnormal row
    x[4, 3] = -0.0
    x[5] = x[5].abs() * torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)  # alternating signs
    return x


# ---------------------------------------------------------------- element formats


def test_e4m3_decode_matches_torch_for_every_bit_pattern():
    bits = torch.arange(256, dtype=torch.uint8)
    ours, theirs = decode_e4m3(bits), bits.view(torch.float8_e4m3fn).float()
    nan = (bits & 0x7F) == 0x7F
    assert torch.isnan(ours[nan]).all()
    assert torch.equal(ours[~nan], theirs[~nan])
    assert torch.equal(torch.signbit(ours[~nan]), torch.signbit(theirs[~nan]))


def test_e2m1_decode_matches_value_list():
    expected = np.concatenate([E2M1_MAGS, -E2M1_MAGS])
    assert np.array_equal(decode_e2m1(torch.arange(16, dtype=torch.uint8)).double().numpy(), expected)


def test_e8m0_decode_is_exact_power_of_two():
    bits = torch.arange(255, dtype=torch.uint8)
    expected = np.ldexp(1.0, np.arange(255) - 127)
    assert np.array_equal(decode_e8m0(bits).double().numpy(), expected)


def e4m3_probe_values():
    mags, mids = E4M3_MAGS, e4m3_midpoints()
    ulp_up = np.nextafter(mids.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    ulp_down = np.nextafter(mids.astype(np.float32), np.float32(0)).astype(np.float64)
    tiny = np.array([0.0, 2.0**-10, 2.0**-11, 2.0**-10 * (1 + 2.0**-23), 2.0**-10 * (1 - 2.0**-24),
                     1e-45, 1e-40, 2.0**-126, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-6, 2.0**-7])
    base = np.concatenate([mags, mids, ulp_up, ulp_down, tiny])
    return torch.from_numpy(np.concatenate([base, -base])).float()


def test_e4m3_encode_matches_torch_cast_on_non_saturating_values():
    x = torch.cat([e4m3_probe_values(), wide_random(50_000, seed=0), torch.tensor([-0.0])])
    x = x[x.abs() <= 448]
    assert torch.equal(encode_e4m3(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e4m3_encode_matches_brute_force_including_saturation():
    big = torch.tensor([448.0, 449.0, 463.99, 464.0, 465.0, 480.0, 1e6, 3e38])
    x = torch.cat([e4m3_probe_values(), wide_random(20_000, seed=1), big, -big])
    expected = brute_force_rne(x.double().numpy(), E4M3_MAGS, 7)
    assert np.array_equal(encode_e4m3(x).numpy(), expected)
    assert not ((encode_e4m3(x) & 0x7F) == 0x7F).any()


def test_e2m1_encode_matches_brute_force_at_every_boundary():
    mids = (E2M1_MAGS[1:] + E2M1_MAGS[:-1]) / 2
    m32 = mids.astype(np.float32)
    near = np.concatenate([np.nextafter(m32, np.float32(np.inf)), np.nextafter(m32, np.float32(0))])
    base = np.concatenate([E2M1_MAGS, mids, near, [0.1, 1e-30, 1e-45, 6.5, 7.0, 100.0, 3e38]])
    x = torch.cat([torch.from_numpy(np.concatenate([base, -base])).float(),
                   wide_random(20_000, seed=2, lo=-6, hi=4)])
    assert np.array_equal(encode_e2m1(x).numpy(), brute_force_rne(x.double().numpy(), E2M1_MAGS, 3))


def test_e2m1_ties_go_to_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # even codes: 0.25->0 (0), 0.75->1 (2), 1.25->1 (2), 1.75->2 (4), 2.5->2 (4), 3.5->4 (6), 5->4 (6)
    assert encode_e2m1(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]


def test_encoders_reject_non_float32():
    with pytest.raises(TypeError, match="float32"):
        encode_e4m3(torch.ones(4, dtype=torch.bfloat16))


# ---------------------------------------------------------------- MXFP8


def test_mxfp8_matches_reference_on_varied_blocks():
    x = varied_rows(24, 256, 32, seed=3)
    x[6, :32] = torch.tensor(np.ldexp(448.0, 3)).float()  # amax exactly 448 * 2**3
    x[6, 32:64] = float(np.nextafter(np.float32(448.0 * 8), np.float32(np.inf)))  # one ulp above
    x[7, :32] = 3e38  # near the fp32 maximum
    q = quantize_mxfp8(x)
    data, scale = ref_mxfp8(x)
    assert q.data.dtype == torch.uint8 and q.scale.dtype == torch.uint8
    assert q.data.shape == (24, 256) and q.scale.shape == (24, 8)
    assert np.array_equal(q.scale.numpy(), scale)
    assert np.array_equal(q.data.numpy(), data)
    assert q.scale[6, 0] == 127 + 3 and q.scale[6, 1] == 127 + 4
    assert q.scale[0].tolist() == [0] * 8 and (q.data[0] & 0x7F).eq(0).all()


def test_mxfp8_elements_match_torch_cast_of_scaled_block():
    x = varied_rows(16, 128, 32, seed=4)
    q = quantize_mxfp8(x)
    scale = torch.from_numpy(np.ldexp(1.0, q.scale.numpy().astype(np.int64) - 127)).float()
    scaled = x.reshape(16, 4, 32) / scale[..., None]
    assert torch.equal(q.data, scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(16, 128))


def test_mxfp8_ties_and_subnormals_inside_a_block():
    mids = e4m3_midpoints()
    for shift in (0, -20, 30):
        vals = np.concatenate([[448.0], mids, [2.0**-10, 2.0**-11, -2.0**-10, 3 * 2.0**-10, -0.0]])
        vals = np.concatenate([vals, -mids[:: 3]])
        vals = np.resize(vals, 32 * ((len(vals) + 31) // 32))
        vals = vals.reshape(-1, 32)
        vals[:, 0] = 448.0  # every block has amax 448 * 2**shift
        x = torch.from_numpy(np.ldexp(vals, shift)).float()
        q = quantize_mxfp8(x)
        data, scale = ref_mxfp8(x)
        assert (q.scale == 127 + shift).all()
        assert np.array_equal(q.data.numpy(), data)


def test_mxfp8_round_trips_representable_values_exactly():
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (32, 128), generator=g, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)
    elems = codes.view(torch.float8_e4m3fn).float().reshape(32, 4, 32)
    shift = torch.randint(-100, 100, (32, 4, 1), generator=g).float()
    x = (elems * torch.exp2(shift)).reshape(32, 128)
    assert torch.equal(dequantize_mxfp8(quantize_mxfp8(x)), x)


def test_mxfp8_dequantize_matches_definition():
    x = varied_rows(8, 64, 32, seed=6)
    q = quantize_mxfp8(x)
    vals = q.data.view(torch.float8_e4m3fn).double().numpy().reshape(8, 2, 32)
    expected = vals * np.ldexp(1.0, q.scale.numpy().astype(np.int64) - 127)[..., None]
    out = dequantize_mxfp8(q)
    assert out.dtype == torch.float32
    assert np.array_equal(out.double().numpy(), f32(expected).reshape(8, 64))
    assert dequantize_mxfp8(q, torch.bfloat16).dtype == torch.bfloat16


def test_mxfp8_bf16_input_is_upcast_and_leading_dims_kept():
    x = torch.randn(2, 3, 64).bfloat16()
    q = quantize_mxfp8(x)
    ref = quantize_mxfp8(x.float())
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale, ref.scale)
    assert q.scale.shape == (2, 3, 2)
    assert q.nbytes == 2 * 3 * 64 + 2 * 3 * 2
    n = quantize_nvfp4(x)
    flat = quantize_nvfp4(x.float().reshape(6, 64))
    assert n.token_scale.shape == (2, 3) and torch.equal(n.token_scale.reshape(6), flat.token_scale)
    assert torch.equal(dequantize_nvfp4(n).reshape(6, 64), dequantize_nvfp4(flat))


# ---------------------------------------------------------------- NVFP4


def check_nvfp4_against_reference(x, q, per_tensor=False):
    codes, bs_bits, ts = ref_nvfp4(x, per_tensor)
    rows, k = x.shape
    assert q.data.shape == (rows, k // 2) and q.data.dtype == torch.uint8
    assert q.block_scale.shape == (rows, k // 16) and q.block_scale.dtype == torch.uint8
    assert q.token_scale.shape == (rows,) and q.token_scale.dtype == torch.float32
    assert np.array_equal(q.token_scale.numpy(), ts)
    assert np.array_equal(q.block_scale.numpy(), bs_bits)
    assert np.array_equal(unpack(q.data), codes)


def test_nvfp4_matches_reference_on_varied_blocks():
    x = varied_rows(32, 128, 16, seed=7)
    x[8] = torch.randn(128) * 1e-3
    x[8, 16:32] = 1e-12  # block scale rounds to zero -> zero data
    check_nvfp4_against_reference(x, quantize_nvfp4(x))
    q = quantize_nvfp4(x)
    assert q.token_scale[0] == 1.0 and (q.data[0] == 0).all() and (q.block_scale[0] == 0).all()
    assert q.block_scale[8, 1] == 0 and (q.data[8, 8:16] == 0).all()


def test_nvfp4_per_tensor_matches_reference():
    x = varied_rows(16, 64, 16, seed=8)
    q = quantize_nvfp4_per_tensor(x)
    check_nvfp4_against_reference(x, q, per_tensor=True)
    assert (q.token_scale == q.token_scale[0]).all()


def test_nvfp4_ties_at_every_e2m1_boundary_and_scale_kind():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected_codes = [0, 2, 2, 4, 4, 6, 6]  # round half to even code
    # block scales: max, normals, the smallest normal, subnormals of E4M3
    scales = [448.0, 1.5, 2.0**-6, 3 * 2.0**-9, 2.0**-9, 13.0, 240.0, 0.875]
    for ts_exp in (0, -40, 20):
        ts = 2.0**ts_exp
        row = []
        for bs in scales:
            elems = [6.0] + ties + [-t for t in ties] + [-0.0]
            row += [e * bs * ts for e in elems]
        row[0] = 6.0 * 448.0 * ts  # amax(row) = 2688 * ts, so token_scale = ts exactly
        x = torch.tensor([row], dtype=torch.float32)
        q = quantize_nvfp4(x)
        check_nvfp4_against_reference(x, q)
        assert q.token_scale.item() == ts
        assert decode_e4m3(q.block_scale[0]).tolist() == scales
        codes = unpack(q.data)[0].reshape(len(scales), 16)
        assert (codes[:, 1:8] == expected_codes).all()
        assert (codes[:, 8:15] == [c | 8 for c in expected_codes]).all()


def test_nvfp4_round_trips_representable_values_exactly():
    g = torch.Generator().manual_seed(9)
    rows, blocks = 16, 8
    codes = torch.randint(0, 16, (rows, blocks, 16), generator=g, dtype=torch.uint8)
    codes[..., 0] = 7  # every block holds +6, so its scale is recovered exactly
    e2m1 = torch.from_numpy(np.concatenate([E2M1_MAGS, -E2M1_MAGS])).float()[codes.long()]
    bs = torch.randint(1, 0x7F, (rows, blocks), generator=g, dtype=torch.uint8)
    bs[:, 0] = 0x7E  # the row maximum 6 * 448 sets the token scale
    bs_val = bs.view(torch.float8_e4m3fn).float()
    ts = torch.exp2(torch.randint(-30, 30, (rows,), generator=g).float())
    x = ((e2m1 * bs_val[..., None]) * ts[:, None, None]).reshape(rows, -1)
    q = quantize_nvfp4(x)
    assert torch.equal(q.token_scale, ts) and torch.equal(q.block_scale, bs)
    assert torch.equal(dequantize_nvfp4(q), x)


def test_nvfp4_dequantize_product_order():
    x = varied_rows(8, 64, 16, seed=10)
    q = quantize_nvfp4(x)
    e2m1 = np.concatenate([E2M1_MAGS, -E2M1_MAGS])[unpack(q.data)].reshape(8, 4, 16)
    bs = E4M3_MAGS[q.block_scale.numpy()][..., None]
    expected = f32(f32(e2m1 * bs) * q.token_scale.double().numpy()[:, None, None]).reshape(8, 64)
    assert np.array_equal(dequantize_nvfp4(q).double().numpy(), expected)


def test_nvfp4_packs_element_2j_in_low_nibble():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -1.0  # codes 7 and 0b1010
    q = quantize_nvfp4(x)
    assert q.data[0, 0].item() == 7 | (0b1010 << 4)


# ---------------------------------------------------------------- batch invariance


def test_per_token_nvfp4_is_batch_invariant_and_per_tensor_is_not():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 64, generator=g)
    other = torch.randn(8, 64, generator=g)
    other[5] *= 100.0  # an outlier token elsewhere in the batch
    t = 2
    mixed = other.clone()
    mixed[t] = x[t]
    fields = ("data", "block_scale", "token_scale")
    a, b, alone = quantize_nvfp4(x), quantize_nvfp4(mixed), quantize_nvfp4(x[t:t + 1])
    for f in fields:
        assert torch.equal(getattr(a, f)[t], getattr(b, f)[t]), f
        assert torch.equal(getattr(a, f)[t], getattr(alone, f)[0]), f
    a, b = quantize_nvfp4_per_tensor(x), quantize_nvfp4_per_tensor(mixed)
    assert not torch.equal(a.data[t], b.data[t])
    assert not torch.equal(a.token_scale[t], b.token_scale[t])


def test_per_token_error_is_smaller_with_outlier_tokens():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 128, generator=g)
    normal = torch.ones(64, dtype=torch.bool)
    normal[::16] = False
    errors = {}
    for outlier in (1.0, 1e5, 1e6):
        y = x.clone()
        y[~normal] *= outlier
        for fmt in ("nvfp4", "nvfp4_per_tensor"):
            errors[fmt, outlier] = ((fake_quantize(y, fmt) - y)[normal].norm() / y[normal].norm()).item()
    # Without outliers the two recipes are equally good; a 1e5x outlier pushes the other
    # tokens' per-tensor block scales into E4M3's subnormals, a 1e6x one flushes them to zero.
    assert errors["nvfp4", 1e5] == errors["nvfp4", 1e6] == errors["nvfp4", 1.0]
    assert errors["nvfp4", 1.0] < 1.1 * errors["nvfp4_per_tensor", 1.0]
    assert errors["nvfp4", 1e5] < 0.8 * errors["nvfp4_per_tensor", 1e5]
    assert errors["nvfp4_per_tensor", 1e6] > 0.5


# ---------------------------------------------------------------- non-finite inputs

NON_FINITE = (float("nan"), -float("nan"), float("inf"), -float("inf"))


def test_e4m3_encodes_nan_and_inf_as_torch_casts_them():
    x = torch.tensor(NON_FINITE)
    assert encode_e4m3(x).tolist() == x.to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7F, 0xFF, 0x7E, 0xFE]
    # E2M1 has no NaN: NaN saturates like inf, at +-6 (codes 7 and 15)
    assert encode_e2m1(x).tolist() == [0x7, 0xF, 0x7, 0xF]


def test_e8m0_nan_code_decodes_to_nan():
    assert torch.isnan(decode_e8m0(torch.tensor([0xFF], dtype=torch.uint8))).all()
    assert decode_e8m0(torch.tensor([0xFE], dtype=torch.uint8)).item() == 2.0**127


def test_mxfp8_non_finite_value_makes_exactly_its_block_nan():
    clean = varied_rows(6, 128, 32, seed=20)
    ref = quantize_mxfp8(clean)
    for bad in NON_FINITE:
        x = clean.clone()
        x[2, 37] = bad  # row 2, block 1 (elements 32..63)
        q = quantize_mxfp8(x)
        hit = torch.zeros(6, 4, dtype=torch.bool)
        hit[2, 1] = True
        assert q.scale[2, 1].item() == 0xFF
        assert torch.equal(q.scale[~hit], ref.scale[~hit])
        data_hit = hit.repeat_interleave(32, dim=1)
        assert torch.equal(q.data[~data_hit], ref.data[~data_hit])
        out = dequantize_mxfp8(q)
        assert torch.isnan(out[data_hit]).all() and torch.isfinite(out[~data_hit]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_nvfp4_non_finite_value_makes_exactly_its_token_nan(dtype):
    clean = varied_rows(6, 64, 16, seed=21).to(dtype).reshape(2, 3, 64)
    ref = quantize_nvfp4(clean)
    for bad in NON_FINITE:
        x = clean.clone()
        x[1, 0, 50] = bad
        q = quantize_nvfp4(x)
        hit = torch.zeros(2, 3, dtype=torch.bool)
        hit[1, 0] = True
        assert torch.isnan(q.token_scale[1, 0]) and (q.block_scale[1, 0] == 0x7F).all()
        for field in ("data", "block_scale", "token_scale"):
            assert torch.equal(getattr(q, field)[~hit], getattr(ref, field)[~hit]), field
        out = dequantize_nvfp4(q)
        assert torch.isnan(out[1, 0]).all() and torch.isfinite(out[~hit]).all()


def test_per_tensor_nvfp4_non_finite_value_makes_every_row_nan():
    for bad in NON_FINITE:
        x = torch.randn(4, 64)
        x[2, 7] = bad
        q = quantize_nvfp4_per_tensor(x)
        assert torch.isnan(q.token_scale).all() and torch.isnan(dequantize_nvfp4(q)).all()


# ---------------------------------------------------------------- errors and helpers


def test_last_dim_not_a_multiple_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"48 is not a multiple of the block size 32.*pad it to 64.*pad_to_block"):
        quantize_mxfp8(torch.randn(2, 48))
    with pytest.raises(ValueError, match=r"40 is not a multiple of the block size 16.*48"):
        quantize_nvfp4(torch.randn(2, 40))
    with pytest.raises(TypeError, match="float64"):
        quantize_mxfp8(torch.randn(2, 32, dtype=torch.float64))


def test_pad_to_block_keeps_real_elements_exact():
    x = varied_rows(8, 48, 16, seed=13)
    padded = pad_to_block(x, 32)
    assert padded.shape == (8, 64) and torch.equal(padded[:, :48], x) and (padded[:, 48:] == 0).all()
    assert pad_to_block(x, 16) is x
    data, scale = ref_mxfp8(padded)
    q = quantize_mxfp8(padded)
    assert np.array_equal(q.data.numpy(), data) and np.array_equal(q.scale.numpy(), scale)
    # the partial block's scale comes from its 16 real elements alone
    assert np.array_equal(q.scale[:, 1].numpy(), ref_mxfp8(torch.cat([x[:, 32:], x[:, 32:]], 1))[1][:, 0])


def test_fake_quantize_preserves_dtype_and_rejects_unknown_format():
    x = torch.randn(4, 64).bfloat16()
    assert fake_quantize(x, "mxfp8").dtype == torch.bfloat16
    assert fake_quantize(x, "nvfp4", torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="fp6"):
        fake_quantize(x, "fp6")


def test_dataclasses_reconstruct_from_plain_tensors():
    x = torch.randn(4, 64)
    q = quantize_mxfp8(x)
    assert torch.equal(dequantize_mxfp8(MXFP8Tensor(q.data.clone(), q.scale.clone())), dequantize_mxfp8(q))
    n = quantize_nvfp4(x)
    assert torch.equal(dequantize_nvfp4(NVFP4Tensor(n.data, n.block_scale, n.token_scale)), dequantize_nvfp4(n))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_mxfp8(MXFP8Tensor(q.data, q.scale[:, :1]))


@pytest.mark.gpu
def test_cuda_quantizers_are_bit_identical_to_cpu():
    x = varied_rows(64, 256, 32, seed=14)
    for fn in (quantize_mxfp8, quantize_nvfp4, quantize_nvfp4_per_tensor):
        cpu, gpu = fn(x), fn(x.cuda())
        for field in cpu.__dataclass_fields__:
            assert torch.equal(getattr(cpu, field), getattr(gpu, field).cpu()), (fn.__name__, field)
