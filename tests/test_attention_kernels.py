"""The attention kernels against a naive fp64 masked-softmax reference (CPU).

Outputs and q/k/v gradients of `causal_attention` (sq == sk and bottom-right
sq < sk blocks) and `packed_causal_attention` (with empty and length-1
documents), with the value head size below the key head size as in MLA. The
CPU path runs SDPA's fused flash kernel (checked by allowing only that
backend, which would raise on a mask or a dv != dk call). The CUDA varlen
plumbing (V padding, scale across `varlen_attn` signatures) is checked here
against a reference stand-in for the kernel.
"""
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_composer.attention import kernels
from megatron_composer.attention.kernels import (
    causal_attention,
    packed_causal_attention,
    select_kernel,
)

ATOL, RTOL = 1e-5, 1e-6
SCALE = 0.3


def reference_attention(q, k, v, q_pos, k_pos, q_doc, k_doc, scale):
    """Plain softmax attention in fp64: key j visible to query i iff same document and
    k_pos[j] <= q_pos[i]. q: [..., sq, dk], k: [..., sk, dk], v: [..., sk, dv]."""
    scores = torch.einsum("...id,...jd->...ij", q.double(), k.double()) * scale
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_doc[None, :] == q_doc[:, None])
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key: 0
    return probs @ v.double()


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _check(fn, ref_fn, tensors, seed=1):
    """fn and ref_fn of the same leaves: outputs and gradients of a random projection."""
    out = fn(*tensors)
    ref_leaves = [t.detach().double().requires_grad_() for t in tensors]
    ref = ref_fn(*ref_leaves)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    grads = torch.autograd.grad((out.double() * g).sum(), tensors)
    ref_grads = torch.autograd.grad((ref * g).sum(), ref_leaves)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a.double(), b, atol=ATOL, rtol=RTOL, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 12), (1, 9), (4, 16), (16, 16)])
@pytest.mark.parametrize("dk,dv", [(24, 16), (16, 16)])
def test_causal_attention_bottom_right_equals_reference(sq, sk, dk, dv):
    q, k, v = _leaves((2, 3, sq, dk), (2, 3, sk, dk), (2, 3, sk, dv), seed=sq * 100 + sk)
    q_pos, k_pos = torch.arange(sq) + sk - sq, torch.arange(sk)
    zeros_q, zeros_k = torch.zeros(sq, dtype=torch.long), torch.zeros(sk, dtype=torch.long)

    def fused(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if the mask/math path were needed
            return causal_attention(q, k, v, SCALE)

    _check(fused, lambda q, k, v: reference_attention(q, k, v, q_pos, k_pos, zeros_q, zeros_k, SCALE),
           [q, k, v])


def _packed_reference(doc_lengths, scale):
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    pos = torch.cat([torch.arange(n) for n in doc_lengths])

    def ref(q, k, v):  # [t, n, d] -> per head [n, t, d]
        out = reference_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                  pos, pos, doc, doc, scale)
        return out.transpose(0, 1)
    return ref


def _cu(doc_lengths):
    return torch.tensor([0] + list(doc_lengths)).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("doc_lengths", [[5, 0, 1, 7, 3], [1, 1, 1], [11], [0, 6, 0]])
def test_packed_causal_attention_equals_reference(doc_lengths):
    t = sum(doc_lengths)
    q, k, v = _leaves((t, 2, 24), (t, 2, 24), (t, 2, 16), seed=t)
    cu = _cu(doc_lengths)

    def fused(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return packed_causal_attention(q, k, v, cu, SCALE, max_seqlen=max(doc_lengths))

    _check(fused, _packed_reference(doc_lengths, SCALE), [q, k, v])


def test_packed_attention_of_only_empty_documents_is_empty():
    q, k, v = torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), torch.zeros(0, 2, 4)
    assert packed_causal_attention(q, k, v, torch.zeros(3, dtype=torch.int32), None).shape == (0, 2, 4)


def test_select_kernel_table():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_kernel("causal", cpu, torch.float32, 8, 8) == "sdpa_causal"
    assert select_kernel("causal", cpu, torch.float32, 4, 8) == "sdpa_zero_query_prefix"
    assert select_kernel("causal", cuda, torch.bfloat16, 4, 8) == "sdpa_lower_right"
    assert select_kernel("packed", cpu, torch.bfloat16) == "sdpa_per_document"
    assert select_kernel("packed", cuda, torch.float32) == "sdpa_per_document"
    expected = "varlen_flash" if kernels.varlen_attn is not None else "sdpa_per_document"
    assert select_kernel("packed", cuda, torch.bfloat16) == expected
    with pytest.raises(ValueError, match="unknown attention op 'dense'"):
        select_kernel("dense", cpu, torch.float32)


def test_causal_attention_rejects_fewer_keys_than_queries():
    q, k, v = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="sq=4 sk=3"):
        causal_attention(q, k, v, None)


# ----------------------------------------------- varlen plumbing, kernel stand-in


def _varlen_standin(new_signature, calls):
    """A reference `varlen_attn` with either torch signature: causal within documents,
    flash's rules (equal head sizes, default scale 1/sqrt(d))."""

    def attend(query, key, value, cu_q, cu_k, max_q, max_k, scale):
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], "flash needs equal head sizes"
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert max_q == max_k == max(lengths)
        s = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        calls.append(scale)
        return _packed_reference(lengths, s)(query, key, value).to(query.dtype)

    if new_signature:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                        scale=None, window_size=(-1, -1), enable_gqa=False):
            assert window_size == (-1, 0)
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                        return_aux=None):
            assert is_causal
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, None)
    return varlen_attn


@pytest.mark.parametrize("new_signature", [True, False])
def test_varlen_path_pads_values_and_applies_the_scale(monkeypatch, new_signature):
    calls = []
    monkeypatch.setattr(kernels, "varlen_attn", _varlen_standin(new_signature, calls))
    lengths = [4, 0, 1, 6]
    t = sum(lengths)
    q, k, v = _leaves((t, 2, 24), (t, 2, 24), (t, 2, 16), seed=5)
    cu = _cu(lengths).long()  # converted to int32 for the kernel
    _check(lambda q, k, v: kernels._varlen_packed(q, k, v, cu, None, SCALE),
           _packed_reference(lengths, SCALE), [q, k, v])
    assert calls == ([SCALE] if new_signature else [None])


def test_values_wider_than_keys_are_rejected():
    q, k, v = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 12)
    with pytest.raises(ValueError, match="value head size 12 exceeds the query/key head size 8"):
        causal_attention(q, k, v, None)


# ----------------------------------------------- V padding, per backend


def test_pads_value_decision_table():
    """torch's sdp_utils rules: flash (CPU, CUDA FA2, varlen) needs one head size for q/k/v;
    CUDA memory-efficient takes V at its own size when both are multiples of its alignment
    (4 for fp32, 8 for fp16/bf16 on sm80+)."""
    pads, bf16 = kernels.pads_value, torch.bfloat16
    assert pads("cpu_flash", 48, 32) and pads("cuda_flash", 192, 128, bf16)
    assert pads("varlen_flash", 192, 128, bf16)
    assert not pads("cuda_efficient", 192, 128) and not pads("cuda_efficient", 192, 128, bf16)
    assert not pads("cuda_efficient", 48, 32)  # the tiny preset, fp32
    assert pads("cuda_efficient", 48, 30) and not pads("cuda_efficient", 46, 30)  # only an aligned K helps
    assert not pads("cuda_efficient", 48, 36) and pads("cuda_efficient", 48, 36, bf16)
    assert not any(pads(b, 64, 64) for b in kernels.BACKENDS)
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn_v9'"):
        pads("cudnn_v9", 64, 32)
    with pytest.raises(ValueError, match="value head size 40 exceeds the query/key head size 32"):
        pads("cuda_flash", 32, 40)


def test_sdpa_backend_by_device_and_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels.sdpa_backend(cpu, torch.bfloat16) == kernels.sdpa_backend(cpu, torch.float32) == "cpu_flash"
    assert kernels.sdpa_backend(cuda, torch.bfloat16) == "cuda_flash"
    assert kernels.sdpa_backend(cuda, torch.float32) == "cuda_efficient"


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 12)])
def test_unpadded_value_path_equals_reference(monkeypatch, sq, sk):
    """The CUDA fp32 path (memory-efficient, V unpadded) played on CPU by SDPA's math kernel:
    SDPA sees V at its own head size, and the result equals the reference."""
    seen = []
    sdpa = kernels._sdpa
    monkeypatch.setattr(kernels, "sdpa_backend", lambda device, dtype: "cuda_efficient")
    monkeypatch.setattr(kernels, "_sdpa", lambda q, k, v, **kw: seen.append(v.shape[-1]) or sdpa(q, k, v, **kw))
    q, k, v = _leaves((2, 3, sq, 24), (2, 3, sk, 24), (2, 3, sk, 16), seed=sq + sk)
    q_pos, k_pos = torch.arange(sq) + sk - sq, torch.arange(sk)
    zeros_q, zeros_k = torch.zeros(sq, dtype=torch.long), torch.zeros(sk, dtype=torch.long)

    def unpadded(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return causal_attention(q, k, v, SCALE)

    _check(unpadded, lambda q, k, v: reference_attention(q, k, v, q_pos, k_pos, zeros_q, zeros_k, SCALE),
           [q, k, v])
    assert seen == [16]
