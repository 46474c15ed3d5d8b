"""Core attention for MLA that runs on any device.

megatron-core 0.16.1 builds MLA's core attention with separate key and value
head sizes (`k_channels = qk_head_dim + qk_pos_emb_head_dim`, `v_channels =
v_head_dim`), and only Transformer Engine's `DotProductAttention` accepts
them. `MLACoreAttention` is the drop-in module for the MLA spec: it takes the
same constructor and forward arguments as megatron-core's core attention and
computes causal softmax attention with `torch.nn.functional.
scaled_dot_product_attention`, which dispatches to fused kernels on CUDA and
to a plain implementation on CPU. Packed sequences (`qkv_format == "thd"`)
are attended document by document from `cu_seqlens`, so no token sees
another document.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def causal_attention(query, key, value, softmax_scale: float):
    """Causal attention where the query block ends at the same token as the keys.

    On CPU, SDPA's fused (flash) kernel needs the value head size to equal the
    query/key head size; MLA's differ (qk_head_dim + qk_pos_emb_head_dim vs
    v_head_dim), which would send SDPA to its math path, materializing the
    [sq, sk] scores and the mask. So on CPU the values are zero-padded to the
    query head size and the padding is cut from the output: the same result,
    a fused kernel, O(s) memory. CUDA's kernels take unequal head sizes as they are.

    Args:
        query: [b, n, sq, dk] float.
        key: [b, n, sk, dk] float, sk >= sq; query i sits at key position sk - sq + i.
        value: [b, n, sk, dv] float.
    Returns:
        [b, n, sq, dv].
    """
    sq, sk = query.shape[-2], key.shape[-2]
    dk, dv = query.shape[-1], value.shape[-1]
    if query.device.type == "cpu" and dv < dk:
        value = F.pad(value, (0, dk - dv))
    if sq == sk:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=softmax_scale)
    else:
        offset = sk - sq
        q_pos = torch.arange(sq, device=query.device) + offset
        k_pos = torch.arange(sk, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=softmax_scale)
    return out[..., :dv]


def packed_causal_attention(query, key, value, cu_seqlens, softmax_scale: float):
    """Causal attention within each packed document.

    Args:
        query: [t, n, dk], key: [t, n, dk], value: [t, n, dv]; t = total tokens.
        cu_seqlens: [docs + 1] int, document start offsets ending with t.
    Returns:
        [t, n, dv].
    """
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # [len, n, d] -> [1, n, len, d]
        q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        outs.append(causal_attention(q, k, v, softmax_scale).squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


class MLACoreAttention(MegatronModule):
    """Causal core attention with qk head dim != v head dim (no TE needed)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(
                f"MLACoreAttention supports causal masks only, got {attn_mask_type}"
            )
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ValueError(
                "MLACoreAttention does not implement attention dropout; set "
                "--attention-dropout 0 (the Composer recipe trains without it)"
            )
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.k_channels = k_channels
        self.v_channels = v_channels
        # Read by MLA's QK-clip bookkeeping; we do not track logits.
        self.current_max_attn_logits = None

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias=None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ):
        """Attend.

        Args:
            query: [s, b, n, dk] (or [t, n, dk] for packed "thd").
            key: same layout as query.
            value: [s, b, n, dv] (or [t, n, dv]).
            attention_mask: ignored (the mask is causal by construction).
        Returns:
            [s, b, n * dv] (or [t, n * dv] for packed).
        """
        if attention_bias is not None:
            raise ValueError("MLACoreAttention does not support an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            out = packed_causal_attention(query, key, value, cu, self.softmax_scale)
            return out.reshape(out.shape[0], -1)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = causal_attention(q, k, v, self.softmax_scale)
        # [b, n, s, dv] -> [s, b, n * dv]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
