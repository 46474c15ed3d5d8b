"""The CUDA attention kernels: memory that fits at 32K tokens, results that match.

- Packed "thd" attention over 32768 tokens in 4 documents (flash varlen) and
  the CP=2 zigzag segment path (`attend_segments`, bottom-right SDPA) run
  forward + backward in bf16 with MLA's head sizes (qk 192, v 128) without the
  peak allocation exceeding 8x the q/k/v + gradient bytes. One head keeps q/k/v
  small next to any [sq, sk] mask (a 32K x 32K bool mask alone is 1 GiB, the
  budget ~0.5 GiB), so a materialized mask or score matrix fails the check.
- On smaller sizes the same paths equal the fp64 masked-softmax reference:
  fp32 (memory-efficient kernel, 1e-4) and bf16 (flash, 2% relative error).
"""
import pytest
import torch

from megatron_composer.attention.cp import attend_segments
from megatron_composer.attention.kernels import causal_attention, packed_causal_attention, select_kernel
from megatron_composer.parallel import ZigzagLayout
from tests.test_attention_kernels import reference_attention

pytestmark = pytest.mark.gpu

DK, DV, SCALE = 192, 128, 192 ** -0.5
MEMORY_MULTIPLE = 8
DOCS_32K = [4096, 12288, 8192, 8192]


def _qkv(tq, tk, heads, dtype, batch_shape=(), seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(t, d):
        return torch.randn(t, *batch_shape, heads, d, device="cuda", dtype=dtype,
                           generator=g).requires_grad_()
    return make(tq, DK), make(tk, DK), make(tk, DV)


def _peak_bytes(fn, tensors):
    """Peak allocation above what existed before `fn` ran forward + backward."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*tensors)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _budget(tensors):
    return MEMORY_MULTIPLE * 2 * sum(t.numel() * t.element_size() for t in tensors)  # + grads


def _cu(doc_lengths):
    return torch.tensor([0] + list(doc_lengths), device="cuda").cumsum(0).to(torch.int32)


def test_packed_32k_four_documents_fits():
    assert select_kernel("packed", torch.device("cuda"), torch.bfloat16) == "varlen_flash"
    t = sum(DOCS_32K)
    tensors = _qkv(t, t, 1, torch.bfloat16)
    cu = _cu(DOCS_32K)
    peak = _peak_bytes(lambda q, k, v: packed_causal_attention(q, k, v, cu, SCALE, max(DOCS_32K)),
                       tensors)
    assert peak <= _budget(tensors), (peak, _budget(tensors))


@pytest.mark.parametrize("packed", [False, True])
def test_cp2_segments_32k_fit(packed):
    layout = ZigzagLayout(tuple(DOCS_32K) if packed else (sum(DOCS_32K),), 2)
    batch = () if packed else (1,)
    for rank in range(2):
        tensors = _qkv(layout.local_length, layout.total_length, 1, torch.bfloat16, batch, seed=rank)
        segments = layout.query_segments(rank)
        peak = _peak_bytes(lambda q, k, v: attend_segments(q, k, v, segments, SCALE, packed), tensors)
        assert peak <= _budget(tensors), (rank, peak, _budget(tensors))


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _compare(fn, ref_fn, tensors, tol):
    """Output and q/k/v gradients of fn vs the fp64 reference on the same leaves."""
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    out, ref = fn(*tensors), ref_fn(*leaves)
    g = torch.randn(ref.shape, device="cuda", dtype=torch.float64,
                    generator=torch.Generator(device="cuda").manual_seed(7))
    assert _rel_err(out, ref) < tol, _rel_err(out, ref)
    grads = torch.autograd.grad((out.double() * g).sum(), tensors)
    ref_grads = torch.autograd.grad((ref * g).sum(), leaves)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert _rel_err(a, b) < tol, (name, _rel_err(a, b))


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _positions(doc_lengths):
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    pos = torch.cat([torch.arange(n) for n in doc_lengths])
    return pos.cuda(), doc.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_matches_reference(dtype):
    docs = [37, 0, 1, 90, 128]
    t = sum(docs)
    pos, doc = _positions(docs)
    cu = _cu(docs)

    def ref(q, k, v):  # [t, n, d] -> [n, t, d]
        out = reference_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                  pos, pos, doc, doc, SCALE)
        return out.transpose(0, 1)

    _compare(lambda q, k, v: packed_causal_attention(q, k, v, cu, SCALE, max(docs)), ref,
             _qkv(t, t, 2, dtype), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,sk", [(96, 96), (64, 256), (1, 77)])
def test_bottom_right_causal_matches_reference(dtype, sq, sk):
    q_pos, k_pos = torch.arange(sq, device="cuda") + sk - sq, torch.arange(sk, device="cuda")
    zq, zk = torch.zeros_like(q_pos), torch.zeros_like(k_pos)
    tensors = [x.detach().permute(1, 2, 0, 3).contiguous().requires_grad_()
               for x in _qkv(sq, sk, 2, dtype, (2,))]  # [b, n, s, d]
    _compare(lambda q, k, v: causal_attention(q, k, v, SCALE),
             lambda q, k, v: reference_attention(q, k, v, q_pos, k_pos, zq, zk, SCALE),
             tensors, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cp2_segments_match_reference(dtype):
    docs = [64, 128, 32]
    layout = ZigzagLayout(tuple(docs), 2)
    pos, doc = _positions(docs)
    for rank in range(2):
        local = layout.local_indices(rank).cuda()
        tensors = _qkv(layout.local_length, layout.total_length, 2, dtype, seed=rank)
        segments = layout.query_segments(rank)

        def ref(q, k, v):
            out = reference_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                      pos[local], pos, doc[local], doc, SCALE)
            return out.transpose(0, 1).reshape(q.shape[0], -1)

        _compare(lambda q, k, v: attend_segments(q, k, v, segments, SCALE, packed=True), ref,
                 tensors, TOLERANCE[dtype])
