"""Causal attention kernels for MLA, chosen per device in one place.

Two operations cover every attention call of the model:

- `causal_attention`: a block of queries against keys, the queries sitting at
  the *last* positions of the keys (bottom-right / "lower right" aligned). A
  whole sequence is the case sq == sk; a zigzag CP segment is sq < sk.
- `packed_causal_attention`: packed "thd" documents, causal within each.

Neither builds an [sq, sk] mask. `select_kernel` is the dispatch table (V is
padded to the key head size for the flash kernels only: `pads_value`):

| operation                  | CPU                         | CUDA fp16 / bf16          | CUDA fp32                  |
|----------------------------|-----------------------------|---------------------------|----------------------------|
| causal, sq == sk           | SDPA is_causal (CPU flash)  | SDPA is_causal (flash)    | SDPA is_causal (mem-eff.)  |
| causal, sq < sk            | zero-query prefix + SDPA    | SDPA `causal_lower_right` | SDPA `causal_lower_right`  |
|                            | is_causal (CPU flash)       | (flash)                   | (mem-efficient)            |
| packed documents           | one SDPA is_causal per doc  | `varlen_attn`, one call   | one SDPA is_causal per doc |

Why each:
- MLA's key head size (qk_head_dim + qk_pos_emb_head_dim) differs from its
  value head size. `pads_value` decides per backend, from torch's own checks
  (sdp_utils): flash kernels (CPU's, CUDA's FA2, and `varlen_attn`, which runs
  FA2) need one head size for q, k and v, so V is zero-padded to the key head
  size and the padding is cut from the output: exact (the padded output columns
  are zero and get zero gradient), at the cost of a padded V copy. CUDA's
  memory-efficient kernel (what fp32 runs) takes V at its own head size when
  both sizes are multiples of its GEMM alignment, so V is not padded there.
  cuDNN's kernel takes unequal sizes too (192/128 on Hopper from cuDNN 9.10),
  but only on a [b, s, h, d] layout that MLA's [s, b, h, d] tensors are not,
  and unpadded bf16 V would steer SDPA from flash to the slower
  memory-efficient kernel: bf16 keeps flash and the padding.
- CUDA, sq < sk: `torch.nn.attention.bias.causal_lower_right` makes SDPA call
  the flash kernel with its native bottom-right causal mask, or the
  memory-efficient kernel with its bottom-right mask type (fp32). No mask is
  built in either. SDPA on CUDA runs with the math backend disabled, so a
  shape no fused kernel takes raises instead of materializing the scores.
  (`causal_lower_right` itself would fall back to a materialized mask only if
  neither fused kernel took the inputs; tests/test_gpu_attention.py bounds the
  peak memory at 32K tokens to catch that.)
- CPU, sq < sk: CPU SDPA's causal mask is top-left aligned, and
  `causal_lower_right` would materialize the mask on CPU. Prepending
  sk - sq zero queries makes the block square, so plain is_causal is exactly
  bottom-right for the real queries; the prefix rows are dropped (their output
  gradient is zero, so they add nothing to dK/dV). Memory stays O(s); compute
  is that of the full sk x sk triangle (at most 2.3x the segment's own work for
  a CP=2 zigzag layout).
- CUDA packed, fp16/bf16: `torch.nn.attention.varlen.varlen_attn` (flash varlen):
  one kernel over all documents from the device `cu_seqlens`, no host sync
  (the longest document comes from `PackedSeqParams.max_seqlen_q`). Flash has no
  fp32 kernel, so fp32 packed batches (CPU-vs-GPU parity checks) go document by
  document like CPU. The CPU loop reads the offsets with `tolist()`, which on
  CPU is no device sync.

Transformer Engine's `thd` attention is the alternative on clusters with TE;
this module is what runs without it.
"""
from __future__ import annotations

import inspect
import itertools
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch releases before torch.nn.attention.varlen
    varlen_attn = None

KERNELS = ("sdpa_causal", "sdpa_lower_right", "sdpa_zero_query_prefix", "varlen_flash",
           "sdpa_per_document")
BACKENDS = ("cpu_flash", "cuda_flash", "cuda_efficient", "varlen_flash")
# CUDA memory-efficient kernel: head sizes must be multiples of this (sm80+, tensor cores).
EFFICIENT_ALIGNMENT = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Every fused CUDA backend; leaving out MATH means no [sq, sk] scores are materialized.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.CUDNN_ATTENTION]


def select_kernel(op: str, device: torch.device, dtype: torch.dtype, sq: int = 0, sk: int = 0) -> str:
    """The kernel that runs `op` ("causal" or "packed") for this device and dtype.

    Returns one of `KERNELS`; see the module docstring for why.
    """
    cuda = torch.device(device).type == "cuda"
    if op == "causal":
        if sq == sk:
            return "sdpa_causal"
        return "sdpa_lower_right" if cuda else "sdpa_zero_query_prefix"
    if op == "packed":
        if cuda and dtype in FLASH_DTYPES and varlen_attn is not None:
            return "varlen_flash"
        return "sdpa_per_document"
    raise ValueError(f"unknown attention op {op!r}; choose 'causal' or 'packed'")


def sdpa_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The fused backend SDPA runs our causal attention on: CPU flash; on CUDA flash
    for fp16/bf16 (V padded to the key head size) and memory-efficient for fp32."""
    if torch.device(device).type != "cuda":
        return "cpu_flash"
    return "cuda_flash" if dtype in FLASH_DTYPES else "cuda_efficient"


def pads_value(backend: str, dk: int, dv: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether `backend` (one of `BACKENDS`) needs V zero-padded from head size `dv` to `dk`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if dv > dk:
        raise ValueError(f"value head size {dv} exceeds the query/key head size {dk}; "
                         "MLA needs v_head_dim <= qk_head_dim + qk_pos_emb_head_dim")
    if dv == dk:
        return False
    if backend == "cuda_efficient":
        # unequal sizes are native; padding helps only an unaligned V next to an aligned K
        align = EFFICIENT_ALIGNMENT.get(dtype, 8)
        return dv % align != 0 and dk % align == 0
    return True  # flash kernels: one head size for q, k and v


def value_for(backend: str, value: torch.Tensor, dk: int) -> torch.Tensor:
    """V as `backend` takes it: zero-padded to `dk` if `pads_value` says so, else as is."""
    if pads_value(backend, dk, value.shape[-1], value.dtype):
        return pad_value(value, dk)
    return value


def _sdpa(query, key, value, **kwargs):
    if query.device.type == "cuda":
        with sdpa_kernel(_CUDA_BACKENDS):
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
    return F.scaled_dot_product_attention(query, key, value, **kwargs)


def pad_value(value: torch.Tensor, dk: int) -> torch.Tensor:
    """V zero-padded on its last dim to the key head size `dk` (no copy if already dk)."""
    dv = value.shape[-1]
    if dv > dk:
        raise ValueError(f"value head size {dv} exceeds the query/key head size {dk}; "
                         "MLA needs v_head_dim <= qk_head_dim + qk_pos_emb_head_dim")
    return value if dv == dk else F.pad(value, (0, dk - dv))


def causal_attention(query, key, value, softmax_scale: Optional[float]):
    """Causal attention, the queries aligned to the last keys (bottom right).

    Args:
        query: [b, n, sq, dk] float.
        key: [b, n, sk, dk] float, sk >= sq; query i sits at key position sk - sq + i.
        value: [b, n, sk, dv] float, dv <= dk.
        softmax_scale: multiplies q.k (None: 1/sqrt(dk)).
    Returns:
        [b, n, sq, dv].
    """
    sq, sk = query.shape[-2], key.shape[-2]
    dk, dv = query.shape[-1], value.shape[-1]
    if sk < sq:
        raise ValueError(f"causal_attention needs at least as many keys as queries, got sq={sq} "
                         f"sk={sk}; pass the query block's whole causal key range")
    value = value_for(sdpa_backend(query.device, query.dtype), value, dk)
    kernel = select_kernel("causal", query.device, query.dtype, sq, sk)
    if kernel == "sdpa_causal":
        out = _sdpa(query, key, value, is_causal=True, scale=softmax_scale)
    elif kernel == "sdpa_lower_right":
        out = _sdpa(query, key, value, attn_mask=causal_lower_right(sq, sk), scale=softmax_scale)
    else:  # sdpa_zero_query_prefix
        prefix = query.new_zeros((*query.shape[:-2], sk - sq, dk))
        out = _sdpa(torch.cat([prefix, query], dim=-2), key, value, is_causal=True,
                    scale=softmax_scale)[..., sk - sq:, :]
    return out[..., :dv]


@lru_cache(maxsize=4)
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _varlen_kwargs(softmax_scale, dk):
    """`varlen_attn`'s causal and scale arguments; its signature changed across torch releases."""
    params = _parameters(varlen_attn)
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kwargs["scale"] = softmax_scale
        return kwargs, 1.0
    # Releases without `scale` use 1/sqrt(dk): fold our scale into the query.
    return kwargs, (1.0 if softmax_scale is None else softmax_scale * dk ** 0.5)


def _varlen_packed(query, key, value, cu_seqlens, max_seqlen, softmax_scale):
    dk, dv = query.shape[-1], value.shape[-1]
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    if max_seqlen is None:  # a host sync; PackedSeqParams.max_seqlen_q avoids it
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    kwargs, q_scale = _varlen_kwargs(softmax_scale, dk)
    if q_scale != 1.0:
        query = query * q_scale
    value = value_for("varlen_flash", value, dk)
    out = varlen_attn(query, key, value, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)
    return out[..., :dv]


def _per_document(query, key, value, cu_seqlens, softmax_scale, doc_lengths=None):
    dv = value.shape[-1]
    # once for all documents
    value = value_for(sdpa_backend(query.device, query.dtype), value, query.shape[-1])
    if doc_lengths is not None:  # known on the host: no read of the device offsets
        bounds = [0, *itertools.accumulate(doc_lengths)]
    else:
        bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # [len, n, d] -> [1, n, len, d]
        q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        outs.append(causal_attention(q, k, v, softmax_scale)[..., :dv].squeeze(0).transpose(0, 1))
    if not outs:
        return query.new_zeros((0, query.shape[1], dv))
    return torch.cat(outs, dim=0)


def packed_causal_attention(query, key, value, cu_seqlens, softmax_scale: Optional[float],
                            max_seqlen: Optional[int] = None, doc_lengths: Optional[tuple[int, ...]] = None):
    """Causal attention within each packed document.

    Args:
        query: [t, n, dk], key: [t, n, dk], value: [t, n, dv]; t = total tokens.
        cu_seqlens: [docs + 1] int, document start offsets ending with t (empty
            documents allowed).
        max_seqlen: longest document (PackedSeqParams.max_seqlen_q); None costs
            a host sync on CUDA.
        doc_lengths: the documents' lengths known on the host (`parallel.zigzag.packed_doc_lengths`);
            None makes the per-document path read `cu_seqlens` (a host sync on CUDA).
    Returns:
        [t, n, dv].
    """
    if select_kernel("packed", query.device, query.dtype) == "varlen_flash":
        return _varlen_packed(query, key, value, cu_seqlens, max_seqlen, softmax_scale)
    return _per_document(query, key, value, cu_seqlens, softmax_scale, doc_lengths)
