"""Core attention for MLA that runs on any device.

megatron-core 0.16.1 builds MLA's core attention with separate key and value
head sizes (`k_channels = qk_head_dim + qk_pos_emb_head_dim`, `v_channels =
v_head_dim`), and only Transformer Engine's `DotProductAttention` accepts
them. `MLACoreAttention` is the drop-in module for the MLA spec: it takes the
same constructor and forward arguments as megatron-core's core attention and
computes causal softmax attention with the fused kernels of `kernels.py`
(flash / memory-efficient SDPA, flash varlen for packed documents, no
materialized masks). Packed sequences (`qkv_format == "thd"`) are attended
within each document of `cu_seqlens`, so no token sees another document.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..parallel.zigzag import packed_doc_lengths
from .kernels import causal_attention, packed_causal_attention


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
            # max_seqlen_q describes cu_seqlens_q; padded offsets that differ need their own.
            same = cu is packed_seq_params.cu_seqlens_q
            max_seqlen = packed_seq_params.max_seqlen_q if same else None
            out = packed_causal_attention(query, key, value, cu, self.softmax_scale, max_seqlen=max_seqlen,
                                          doc_lengths=packed_doc_lengths(packed_seq_params))
            return out.reshape(out.shape[0], -1)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = causal_attention(q, k, v, self.softmax_scale)
        # [b, n, s, dv] -> [s, b, n * dv]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
