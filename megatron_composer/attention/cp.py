"""Context-parallel MLA: all-gather the KV latents, not the expanded K/V.

The Composer 2 report's scheme. Per layer, each CP rank

1. computes its local KV latents: `linear_kv_down_proj` -> split into the
   compressed kv (then `kv_layernorm`) and the shared rope key, RoPE applied
   at each token's true global position (from the zigzag layout);
2. starts an asynchronous all-gather of the latents over the CP group,
3. computes its queries q = q_up(q_norm(q_down(x))) while the gather runs,
4. waits, un-zigzags the gathered latents into global order and up-projects
   K/V for the full sequence (`linear_kv_up_proj` is small);
5. attends its local zigzag queries to the full K/V, each query chunk
   against the causal prefix of its own document.

With recompute of "mla_up_proj" (`--recompute-granularity selective
--recompute-modules mla_up_proj`) steps 3 and 4's up-projections run under
megatron-core's `CheckpointWithoutOutput`: backward keeps only the compressed
query and the gathered latents, and the expanded query, K and V are freed after
core attention and recomputed when its gradient arrives.

Backward of the gather is a reduce-scatter (sum) of the latent gradients to
each rank's own tokens. Per token and layer that moves kv_lora_rank +
qk_pos_emb_head_dim numbers (576 for Kimi K2.5) instead of the expanded
heads x (qk + rope + v) (20480) of megatron-core's TE ring, which is why the
report gathers latents.

Departures from megatron-core, on purpose: its MLA computes RoPE for
positions 0..s-1 of the local chunk and, with a CP group, assumes its own
split; its CP attention runs only through Transformer Engine on expanded K/V.
`ContextParallelMLASelfAttention` is selected through the layer spec
(`models.builder`) when context_parallel_size > 1; nothing is patched.
TP must be 1 under CP (the recipe folds CP, not TP, with EP).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from ..parallel.collectives import all_gather_single, reduce_scatter_single
from ..parallel import Segment, ZigzagLayout
from .core import MLACoreAttention
from .kernels import causal_attention, sdpa_backend, value_for


# ------------------------------------------------------------ collectives


def reduce_scatter_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's slice of dim 0.

    Args:
        x: [cp * s, ...] rank-major (rows r*s..(r+1)*s belong to rank r).
    Returns:
        [s, ...]. (NCCL and gloo both implement reduce_scatter, as FSDP2 needs.)
    """
    size = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _GatheredLatents(torch.autograd.Function):
    """Autograd end of `latent_all_gather`: forward waits, backward reduce-scatters."""

    @staticmethod
    def forward(ctx, local, pending):
        ctx.group = pending.group
        pending.work.wait()
        return pending.output

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sum(grad, ctx.group), None


class LatentAllGather:
    """An all-gather in flight; `wait()` returns the gathered latents (differentiable)."""

    def __init__(self, local: torch.Tensor, group):
        self.local = local
        self.group = group
        size = dist.get_world_size(group)
        self.output = torch.empty((size * local.shape[0], *local.shape[1:]),
                                  dtype=local.dtype, device=local.device)
        self.work = all_gather_single(self.output, local.detach().contiguous(),
                                      group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        """[cp * s, ...] rank-major; gradients flow back to each rank's `local`."""
        return _GatheredLatents.apply(self.local, self)


def latent_all_gather(local: torch.Tensor, group) -> LatentAllGather:
    """Start gathering `local` ([s, ...]) from every rank of `group` along dim 0."""
    return LatentAllGather(local, group)


# ------------------------------------------------------------ attention


def attend_segments(query, key, value, segments: list[Segment], softmax_scale: float,
                    packed: bool) -> torch.Tensor:
    """Local query chunks against their causal key ranges of the full sequence.

    Args:
        query: [s_local, b, n, dk] (packed: [t_local, n, dk]).
        key: [s, b, n, dk] (packed: [t, n, dk]), global token order.
        value: [s, b, n, dv] (packed: [t, n, dv]).
        segments: from `ZigzagLayout.query_segments`, covering the local tokens in order.
    Returns:
        [s_local, b, n * dv] (packed: [t_local, n * dv]).
    """
    dv = value.shape[-1]
    # once, not per overlapping key range
    value = value_for(sdpa_backend(query.device, query.dtype), value, query.shape[-1])
    outs = []
    for seg in segments:
        q, k, v = query[seg.q_start:seg.q_end], key[seg.k_start:seg.k_end], value[seg.k_start:seg.k_end]
        if packed:  # [len, n, d] -> [1, n, len, d]
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out = causal_attention(q, k, v, softmax_scale)[..., :dv].squeeze(0).transpose(0, 1)
            outs.append(out.reshape(out.shape[0], -1))
        else:  # [len, b, n, d] -> [b, n, len, d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
            out = causal_attention(q, k, v, softmax_scale)[..., :dv]
            outs.append(out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1))
    return torch.cat(outs, dim=0)


class ZigzagCoreAttention(MLACoreAttention):
    """Core attention for local zigzag queries against full-sequence K/V."""

    def __init__(self, *args, pg_collection=None, **kwargs):
        super().__init__(*args, pg_collection=pg_collection, **kwargs)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp"])
        self.cp_group = pg_collection.cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """query: local tokens; key/value: the whole sequence (see `attend_segments`)."""
        if attention_bias is not None:
            raise ValueError("ZigzagCoreAttention does not support an attention bias")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        layout = ZigzagLayout.for_local_tokens(query.shape[0], cp_size, packed_seq_params)
        if key.shape[0] != layout.total_length:
            raise ValueError(
                f"ZigzagCoreAttention needs full-sequence keys ({layout.total_length} tokens), "
                f"got {key.shape[0]}; build the layer with ContextParallelMLASelfAttention"
            )
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        return attend_segments(query, key, value, layout.query_segments(cp_rank),
                               self.softmax_scale, packed)


class ContextParallelMLASelfAttention(MLASelfAttention):
    """MLA self-attention whose CP communication is one latent all-gather per layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.pg_collection.tp.size() > 1:
            raise ValueError(
                f"context-parallel MLA needs TP=1, got TP={self.pg_collection.tp.size()}; "
                "use CP x EP instead of TP (the recipe's layout)"
            )
        if self.config.cache_mla_latents:
            raise ValueError("context-parallel MLA does not support cache_mla_latents (an "
                             "inference option); run inference with CP=1")

    def _rope_freqs(self, layout: ZigzagLayout, rank: int):
        """RoPE angles of this rank's tokens at their true positions: [s_local, 1, 1, d], mscale."""
        longest = max(layout.doc_lengths)
        if self.config.rope_type == "rope":
            table, mscale = self.rotary_pos_emb(longest, packed_seq=True), 1.0
        else:
            table, mscale = self.rotary_pos_emb(longest, packed_seq=True)
        # packed_seq=True: the whole table, without megatron's own CP slicing.
        return table.index_select(0, layout.positions(rank, table.device)), mscale

    def _rope(self, x, freqs, mscale):
        return apply_rotary_pos_emb(x, freqs, config=self.config, cu_seqlens=None, mscale=mscale,
                                    cp_group=self.pg_collection.cp)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *,
                                    inference_params=None):
        """Local queries, full-sequence keys and values.

        Args:
            hidden_states: [s_local, b, h] (packed: [t_local, 1, h]), zigzag order.
        Returns:
            query [s_local, b, n, qk+rope] (packed [t_local, n, qk+rope]),
            key [s, b, n, qk+rope], value [s, b, n, v] (packed: [t, n, .]) in
            global order, q_compressed, kv_compressed (local).
        """
        if inference_context is not None or inference_params is not None:
            raise ValueError("context-parallel MLA is for training; run inference with CP=1")
        cfg = self.config
        group = self.pg_collection.cp
        rank = group.rank()
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        layout = ZigzagLayout.for_local_tokens(hidden_states.shape[0], group.size(),
                                               packed_seq_params)
        freqs, mscale = self._rope_freqs(layout, rank)
        if packed:
            freqs = freqs[:, 0]  # [t, 1, d], broadcast over heads of [t, n, d]

        # 1. local latents: normed compressed kv + rope key at global positions
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_compressed, k_pos_emb = torch.split(
            kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        if packed:
            kv_compressed, k_pos_emb = kv_compressed.squeeze(1), k_pos_emb.squeeze(1)
        kv_compressed = self.kv_layernorm(kv_compressed)
        k_pos_emb = self._rope(k_pos_emb.unsqueeze(-2), freqs, mscale).squeeze(-2)
        latent = torch.cat([kv_compressed, k_pos_emb], dim=-1)

        # 2. gather starts; 3. queries while it runs
        pending = latent_all_gather(latent, group)
        if cfg.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if packed:
                q_compressed = q_compressed.squeeze(1)
            q_compressed = self.q_layernorm(q_compressed)
        else:
            q_compressed = hidden_states.squeeze(1) if packed else hidden_states
        checkpoints = _UpProjCheckpoints(cfg) if self.recompute_up_proj else None

        def query_up(q_compressed):
            return self._query_up_proj(q_compressed, freqs, mscale)

        query = _maybe_checkpoint(checkpoints, query_up, q_compressed)

        # 4. full latents in global order, K/V up-projection
        full = pending.wait().index_select(0, layout.unzigzag_index(latent.device))
        key, value = _maybe_checkpoint(checkpoints, self._kv_up_proj, full)
        # megatron-core's MLA forward discards the up-projected tensors after core
        # attention and recomputes them when the core attention's gradient arrives.
        self.qkv_up_checkpoint = checkpoints
        return query, key, value, q_compressed, kv_compressed

    def _query_up_proj(self, q_compressed, freqs, mscale):
        """[s_local, b, q_lora_rank or h] (packed [t_local, .]) -> query [.., n, qk+rope],
        RoPE at the tokens' true positions, contiguous."""
        cfg = self.config
        if cfg.q_lora_rank is not None:
            q, _ = self.linear_q_up_proj(q_compressed)
        else:
            q, _ = self.linear_q_proj(q_compressed)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)
        q_no_pe, q_pos_emb = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        return torch.cat([q_no_pe, self._rope(q_pos_emb, freqs, mscale)], dim=-1).contiguous()

    def _kv_up_proj(self, full):
        """Full latents [s, b, kv_lora_rank + rope] (packed [t, .], global order, RoPE
        applied) -> key [.., n, qk+rope], value [.., n, v], contiguous."""
        cfg = self.config
        kv_full, k_pos_full = torch.split(full, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        kv, _ = self.linear_kv_up_proj(kv_full)
        kv = kv.view(*kv.shape[:-1], self.num_attention_heads_per_partition,
                     cfg.qk_head_dim + cfg.v_head_dim)
        k_no_pe, value = torch.split(kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        k_pos_full = k_pos_full.unsqueeze(-2).expand(*k_no_pe.shape[:-1], cfg.qk_pos_emb_head_dim)
        key = torch.cat([k_no_pe, k_pos_full], dim=-1)
        return key.contiguous(), value.contiguous()


class _UpProjCheckpoints:
    """The query and the K/V up-projection checkpoints of one layer, released together.

    Two checkpoints, not one as in megatron-core's MLA, so the query
    up-projection still overlaps the latent all-gather. Quacks like the
    `CheckpointWithoutOutput` that `MLASelfAttention.forward` releases.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.parts = []

    def checkpoint(self, fn, *args):
        part = tensor_parallel.CheckpointWithoutOutput(fp8=self.cfg.fp8 or self.cfg.fp4)
        self.parts.append(part)
        return part.checkpoint(fn, *args)

    def discard_output_and_register_recompute(self, hook_tensor):
        for part in self.parts:
            part.discard_output_and_register_recompute(hook_tensor)


def _maybe_checkpoint(checkpoints, fn, *args):
    return fn(*args) if checkpoints is None else checkpoints.checkpoint(fn, *args)
