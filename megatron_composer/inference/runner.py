"""Incremental forward of the Composer model over a latent KV cache.

megatron-core 0.16.1 caches MLA latents only in its dynamic inference
context, whose attention is FlashMLA / flash-attn on CUDA (and whose memory
pool is CUDA-only), so none of it runs on a CPU. The runner keeps
megatron-core's modules and calls them in `TransformerLayer` order
(input norm, attention, residual, pre-MLP norm, dense or MoE MLP, residual;
MTP's enorm / hnorm / eh_proj / layer / final norm); only MLA's attention
with a cache is ours:

1. q: `linear_q_down_proj` -> `q_layernorm` -> `linear_q_up_proj` (or
   `linear_q_proj`), split into q_nope [n_heads, qk_head_dim] and q_pe.
2. latent: `linear_kv_down_proj` -> (c_kv, k_pe); c_kv -> `kv_layernorm`;
   RoPE on q_pe and k_pe at the tokens' true positions (megatron-core's
   rotary table and unfused RoPE).
3. the cache stores [c_kv (kv_lora_rank) | k_pe (qk_pos_emb_head_dim)] per
   token and layer: per-head keys and values are never expanded.
4. absorbed attention: with W_UK, W_UV the key / value halves of
   `linear_kv_up_proj` [n_heads, ., kv_lora_rank],
       score(t, j) = (q_nope W_UK) . c_j + q_pe . k_pe_j      (x softmax_scale)
       out(t)      = W_UV (sum_j softmax(score)_j c_j)
   which equals attention over the up-projected keys and values.
5. `linear_proj`, the residual, the MLP (experts of MoE layers recorded by a
   megatron-core `RouterReplay` in record mode).

Requests are "segments" (cache slot, first position, number of new tokens);
one forward runs every segment's tokens as one flat batch. Short segments
of equal length (decode tokens, speculative verification) attend in one
batched matmul; prompt chunks attend through SDPA with the causal offset.

MoE layers with every expert local skip megatron-core's token dispatcher:
the layer's own router (which records the experts), shared expert and
experts run on the tokens permuted and un-permuted exactly as the alltoall
dispatcher does when there is no peer to exchange with (`masked_select` over
the expert-major routing map, `index_add_` back; `_moe`). On CPU outputs are
bit-identical; at decode sizes on CPU the dispatcher's bookkeeping for an
all-to-all without peers was about a quarter of the MoE layer's time.

The linears the runner calls itself (MLA's projections, MTP's `eh_proj`,
the output head) are megatron-core's `ColumnParallelLinear` /
`RowParallelLinear`, whose forward at TP = 1 is `x @ weight.T` (+ bias) behind
an autograd function, a TP copy region and their Python plumbing; the runner
multiplies their weights with one `F.linear` (`_linear`), the same product.
On CPU at decode sizes that plumbing measured 25-60 us per call against ~5 us
for the product: doing this for all 25 linears of a tiny-preset decode step
saved a quarter of its time. The runner does it for the 17 it calls itself;
MLP modules keep their own linears.
Supports the local layer spec at TP = PP = EP = 1 (any CP: weights are replicated over it).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..moe import DeviceCountsAlltoAllTokenDispatcher, DeviceCountsMoELayer
from ..parallel.wrappers import unwrap


# Segments up to this many new tokens attend batched (decode, verification); longer ones through SDPA.
_BATCHED_QUERIES = 8

# The MLA projections the runner calls itself (`linear_kv_up_proj` is absorbed into the attention).
_ATTENTION_LINEARS = ("linear_q_down_proj", "linear_q_up_proj", "linear_q_proj", "linear_kv_down_proj", "linear_proj")


@dataclasses.dataclass(frozen=True)
class Segment:
    """New tokens of one request in one forward: cache `slot`, positions start .. start + length - 1."""

    slot: int
    start: int
    length: int


@dataclasses.dataclass
class _Group:
    """Segments of equal short length n attending together."""

    rows: torch.Tensor  # [B * n] rows of the flat batch
    slots: torch.Tensor  # [B]
    visible: torch.Tensor  # [B, n, L] key position <= query position
    batch: int
    n: int


class AttentionPlan:
    """Index tensors of one forward's segments, built once and used by every layer."""

    def __init__(self, segments: list[Segment], device):
        self.segments = segments
        slots, positions, offsets, total = [], [], [], 0
        for seg in segments:
            slots += [seg.slot] * seg.length
            positions += range(seg.start, seg.start + seg.length)
            offsets.append(total)
            total += seg.length
        self.write_slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.write_positions = torch.tensor(positions, dtype=torch.long, device=device)
        members: dict[int, list[int]] = {}
        self.chunks = []  # (flat offset, segment, causal mask [n, start + n])
        for i, seg in enumerate(segments):
            if seg.length <= _BATCHED_QUERIES:
                members.setdefault(seg.length, []).append(i)
            else:
                end = seg.start + seg.length
                mask = torch.arange(end, device=device)[None] <= torch.arange(seg.start, end, device=device)[:, None]
                self.chunks.append((offsets[i], seg, mask))
        self.groups = []
        for n, idx in members.items():
            rows = torch.tensor([offsets[i] + j for i in idx for j in range(n)], dtype=torch.long, device=device)
            longest = max(segments[i].start for i in idx) + n
            query_pos = torch.tensor([[segments[i].start + j for j in range(n)] for i in idx], device=device)
            visible = torch.arange(longest, device=device)[None, None] <= query_pos[:, :, None]
            slots_t = torch.tensor([segments[i].slot for i in idx], dtype=torch.long, device=device)
            self.groups.append(_Group(rows, slots_t, visible, len(idx), n))


class _RoutingRecorder(RouterReplay):
    """megatron-core's RouterReplay in record mode, kept out of its global list
    (that list is the trainer's replay order); any replay action the trainer
    set on the router is bypassed while the engine runs."""

    def __init__(self):  # no super().__init__(): it registers the instance globally
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = RouterReplayAction.RECORD
        self.replay_backward_list = []


class LatentCache:
    """Per layer and slot: [max_len, kv_lora_rank + qk_pos_emb_head_dim] latents, allocated on first use."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, width: int, dtype, device):
        self.shape = (num_layers, num_slots, max_len, width)
        self.dtype, self.device = dtype, device
        self._data: Optional[torch.Tensor] = None

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self._data

    def bytes_per_token(self) -> int:
        return self.shape[0] * self.shape[3] * torch.empty((), dtype=self.dtype).element_size()


class ModelRunner:
    """The model's trunk, MTP layers and output head over two latent caches (trunk, MTP)."""

    def __init__(self, model, num_slots: int, max_len: int):
        gpt = unwrap(model)
        cfg = gpt.config
        # Context parallelism replicates every weight, so a CP model decodes whole
        # sequences on each rank (its CP attention's forward is never called).
        for name, size in (("tensor", cfg.tensor_model_parallel_size), ("pipeline", cfg.pipeline_model_parallel_size),
                           ("expert", cfg.expert_model_parallel_size)):
            if size != 1:
                raise ValueError(f"the inference engine runs one model replica per process; got {name}-parallel "
                                 f"size {size}; build the engine's model with {name}-parallel size 1")
        if cfg.transformer_impl != "local":
            raise ValueError(f"the inference engine reads megatron-core's local layer spec; got transformer_impl "
                             f"{cfg.transformer_impl!r}; build with --transformer-impl local (checkpoints are "
                             f"the same for both)")
        self.gpt, self.cfg = gpt, cfg
        self.layers = list(gpt.decoder.layers)
        self.mtp_layers = list(gpt.mtp.layers) if getattr(gpt, "mtp", None) is not None else []
        self.moe_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoELayer)]
        self.max_len = max_len
        param = next(gpt.parameters())
        width = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        self.cache = LatentCache(len(self.layers), num_slots, max_len, width, param.dtype, param.device)
        self.mtp_cache = LatentCache(max(1, len(self.mtp_layers)), num_slots, max_len, width, param.dtype,
                                     param.device)
        attn = self.layers[0].self_attention
        table = attn.rotary_pos_emb(max_len, packed_seq=True)  # [max_len, 1, 1, rope dim] (+ mscale for yarn)
        self.rope_table, self.rope_mscale = table if isinstance(table, tuple) else (table, 1.0)
        self.device, self.dtype = param.device, param.dtype
        self._mlp = {layer: self._moe if self._dispatch_free(layer.mlp) else self._module_mlp
                     for layer in self.layers + [m.transformer_layer for m in self.mtp_layers]}
        attentions = [layer.self_attention for layer in self.layers + [m.transformer_layer for m in self.mtp_layers]]
        linears = [gpt.output_layer] + [m.eh_proj for m in self.mtp_layers] + [
            getattr(attn, name) for attn in attentions for name in _ATTENTION_LINEARS
            if getattr(attn, name, None) is not None]
        direct = all(type(m) in (ColumnParallelLinear, RowParallelLinear) for m in linears)
        self._linear = self._direct_linear if direct else self._module_linear

    @staticmethod
    def _dispatch_free(mlp) -> bool:
        """Whether `_moe` computes this MLP exactly: a megatron-core MoELayer with every expert local and
        the alltoall dispatcher without token dropping, padding, fused permutation or a latent projection."""
        if (type(mlp) not in (MoELayer, DeviceCountsMoELayer) or type(mlp.token_dispatcher)
                not in (MoEAlltoAllTokenDispatcher, DeviceCountsAlltoAllTokenDispatcher)):
            return False
        cfg = mlp.config
        return (mlp.num_local_experts == cfg.num_moe_experts and not mlp.shared_expert_overlap
                and cfg.moe_expert_capacity_factor is None and not cfg.moe_router_padding_for_quantization
                and not cfg.moe_latent_size and not cfg.moe_permute_fusion and not cfg.add_bias_linear)

    # ------------------------------------------------------------ public
    def trunk(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
              record_experts: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Feed new tokens through the decoder (writing their latents into the cache).

        Args:
            tokens, positions: [T] int64, the segments' tokens concatenated.
        Returns:
            (hidden [T, hidden] after the decoder's final norm,
             routed experts int32 [T, num_moe_layers, topk] or None).
        """
        x = self.gpt.embedding(input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0))
        freqs = self.rope_table.index_select(0, positions)
        plan = AttentionPlan(segments, tokens.device)
        recorders = {}
        with self._routers(recorders):
            for index, layer in enumerate(self.layers):
                x = self._layer(layer, x, freqs, plan, self.cache.data[index])
        hidden = self.gpt.decoder.final_layernorm(x)
        routed = None
        if record_experts and self.moe_layers:
            routed = torch.stack([recorders[i].recorded_topk_idx for i in self.moe_layers], dim=1).to(torch.int32)
        return hidden.squeeze(1), routed

    def mtp(self, depth: int, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
            segments: list[Segment]) -> torch.Tensor:
        """MTP layer `depth` (0-based) at `positions`: hidden [T, h] of the previous stage at
        position p and the embedding of token p + depth + 1 -> its normed output [T, h]."""
        layer = self.mtp_layers[depth]
        emb = self.gpt.embedding(input_ids=next_tokens.unsqueeze(0), position_ids=positions.unsqueeze(0))
        x, _ = self._linear(layer.eh_proj, torch.cat((layer.enorm(emb), layer.hnorm(hidden.unsqueeze(1))), -1))
        freqs = self.rope_table.index_select(0, positions)
        with self._routers({}):
            x = self._layer(layer.transformer_layer, x, freqs, AttentionPlan(segments, positions.device),
                            self.mtp_cache.data[depth])
        return layer.final_layernorm(x).squeeze(1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: hidden [n, h] -> float32 logits [n, vocab]."""
        gpt = self.gpt
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        out, _ = self._linear(gpt.output_layer, hidden.unsqueeze(1), weight)
        return out.squeeze(1).float()

    def kv_bytes_per_token(self) -> dict[str, int]:
        """Cache bytes per token (trunk layers): latent vs per-head K and V expanded."""
        cfg = self.cfg
        size = torch.empty((), dtype=self.dtype).element_size()
        heads = cfg.num_attention_heads
        expanded = heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim)
        return {"latent": self.cache.bytes_per_token(), "expanded": len(self.layers) * expanded * size}

    # ------------------------------------------------------------ layers
    @contextlib.contextmanager
    def _routers(self, recorders: dict):
        routers = []
        for i, layer in enumerate(self.layers + [m.transformer_layer for m in self.mtp_layers]):
            if isinstance(layer.mlp, MoELayer):
                recorders[i] = _RoutingRecorder()
                routers.append((layer.mlp.router, layer.mlp.router.router_replay))
                layer.mlp.router.router_replay = recorders[i]
        try:
            yield
        finally:
            for router, previous in routers:
                router.router_replay = previous

    def _layer(self, layer, x, freqs, plan, cache):
        attn = self._attention(layer.self_attention, layer.input_layernorm(x), freqs, plan, cache)
        x = x + attn
        out, bias = self._mlp[layer](layer.mlp, layer.pre_mlp_layernorm(x))
        if bias is not None:
            out = out + bias
        return x + out

    @staticmethod
    def _module_mlp(mlp, x):
        return mlp(x)

    @staticmethod
    def _direct_linear(linear, x, weight=None):
        """megatron-core's Column/RowParallelLinear forward at TP = 1 as one F.linear (module docstring):
        x [..., in] -> (x @ W.T (+ bias unless skip_bias_add) [..., out], the bias when skip_bias_add)."""
        weight = linear.weight if weight is None else weight
        if linear.skip_bias_add:
            return F.linear(x, weight), linear.bias
        return F.linear(x, weight, linear.bias), None

    @staticmethod
    def _module_linear(linear, x, weight=None):
        if weight is None:
            return linear(x)
        return linear(x, weight=weight, runtime_gather_output=True)

    @staticmethod
    def _moe(mlp, x):
        """megatron-core's MoELayer.forward with every expert local, without its dispatcher (module
        docstring): x [T, 1, h] -> (routed + shared expert output [T, 1, h], None)."""
        shared = mlp.shared_experts(x) if mlp.use_shared_expert else None
        probs, routing_map = mlp.router(x)  # [T, E] float32, [T, E] bool
        flat = x.view(-1, x.shape[-1])
        by_expert = routing_map.t().contiguous()  # [E, T]: expert-major, the dispatcher's order
        tokens = torch.arange(flat.shape[0], device=x.device).expand_as(by_expert).masked_select(by_expert)
        out, _ = mlp.experts(flat.index_select(0, tokens), routing_map.sum(dim=0),
                             probs.t().contiguous().masked_select(by_expert))
        routed = torch.zeros_like(flat).index_add_(0, tokens, out).view(x.shape)
        return (routed if shared is None else routed + shared), None

    def _rope(self, t, freqs):
        # megatron-core's unfused RoPE (the fused kernels have no per-token positions)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t, freqs, rotary_interleaved=self.cfg.rotary_interleaved,
            multi_latent_attention=self.cfg.multi_latent_attention, mscale=self.rope_mscale)

    def _attention(self, attn, x, freqs, plan, cache):
        """x [T, 1, h] (normed) -> attention output [T, 1, h]; writes the tokens' latents into `cache`."""
        cfg = self.cfg
        tokens = x.shape[0]
        heads = attn.num_attention_heads_per_partition
        dn, dr, dv, rank = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is not None:
            q_compressed, _ = self._linear(attn.linear_q_down_proj, x)
            q, _ = self._linear(attn.linear_q_up_proj, attn.q_layernorm(q_compressed))
        else:
            q, _ = self._linear(attn.linear_q_proj, x)
        q_nope, q_pe = torch.split(q.view(tokens, 1, heads, dn + dr), [dn, dr], dim=-1)
        kv, _ = self._linear(attn.linear_kv_down_proj, x)
        c_kv, k_pe = torch.split(kv, [rank, dr], dim=-1)
        c_kv = attn.kv_layernorm(c_kv)
        k_pe = self._rope(k_pe.unsqueeze(2), freqs)  # [T, 1, 1, dr]
        q_pe = self._rope(q_pe, freqs)  # [T, 1, heads, dr]
        latent = torch.cat([c_kv.view(tokens, rank), k_pe.view(tokens, dr)], dim=-1)

        cache[plan.write_slots, plan.write_positions] = latent

        up = attn.linear_kv_up_proj.weight.view(heads, dn + dv, rank)
        w_uk, w_uv = up[:, :dn], up[:, dn:]
        query = torch.cat([torch.einsum("thd,hdc->thc", q_nope.view(tokens, heads, dn), w_uk),
                           q_pe.view(tokens, heads, dr)], dim=-1)  # [T, heads, rank + dr]
        out_latent = self._attend(query, plan, cache, attn.softmax_scale, rank)
        out = torch.einsum("thc,hvc->thv", out_latent, w_uv).reshape(tokens, 1, heads * dv)
        out, bias = self._linear(attn.linear_proj, out)
        return out if bias is None else out + bias

    @staticmethod
    def _attend(query, plan: AttentionPlan, cache, scale, rank):
        """Absorbed attention of every segment's queries over its cached latents -> [T, heads, rank].

        Short segments (decode tokens, speculative verification) of equal length attend
        in one batched matmul; prompt chunks attend one by one through SDPA.
        """
        out = query.new_empty(query.shape[0], query.shape[1], rank)
        for g in plan.groups:
            keys = cache[:, :g.visible.shape[-1]].index_select(0, g.slots)  # [B, L, rank + dr]
            q = query.index_select(0, g.rows).view(g.batch, g.n, *query.shape[1:])  # [B, n, heads, .]
            scores = torch.einsum("bnhk,blk->bhnl", q, keys).float() * scale
            probs = torch.softmax(scores.masked_fill(~g.visible[:, None], float("-inf")), dim=-1)
            o = torch.einsum("bhnl,blc->bnhc", probs.to(keys.dtype), keys[..., :rank])
            out[g.rows] = o.reshape(-1, *o.shape[2:])
        for offset, seg, mask in plan.chunks:
            q = query[offset:offset + seg.length].transpose(0, 1).unsqueeze(0)  # [1, heads, n, .]
            end = seg.start + seg.length
            keys = cache[seg.slot, :end]
            heads = q.shape[1]
            k = keys.view(1, 1, end, -1).expand(1, heads, end, keys.shape[-1])
            v = keys[:, :rank].reshape(1, 1, end, rank).expand(1, heads, end, rank)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[offset:offset + seg.length] = o[0].transpose(0, 1)
        return out
