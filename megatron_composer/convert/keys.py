"""Tensor names: published DeepSeek-V3 / Kimi-K2 safetensors <-> our checkpoint.

Our side is the checkpoint's stored names (`checkpoint.state`): routed
experts by global index E, whichever implementation held them
(SequentialMLP's `local_experts.{i}.linear_fc1.weight` and TEGroupedMLP's
`linear_fc1.weight{i}` are stored alike), so the map below serves
checkpoints of both `--transformer-impl`s.

Every megatron-core tensor is its HF tensor(s) concatenated along dim 0:

    model.embed_tokens                      embedding.word_embeddings
    model.layers.L.input_layernorm          decoder.layers.L.input_layernorm
    model.layers.L.self_attn.q_a_proj       decoder.layers.L.self_attention.linear_q_down_proj
                          .q_a_layernorm                                   .q_layernorm
                          .q_b_proj                                        .linear_q_up_proj
                          .q_proj  (no q LoRA)                             .linear_q_proj
                          .kv_a_proj_with_mqa                              .linear_kv_down_proj
                          .kv_a_layernorm                                  .kv_layernorm
                          .kv_b_proj                                       .linear_kv_up_proj
                          .o_proj                                          .linear_proj
    model.layers.L.post_attention_layernorm decoder.layers.L.pre_mlp_layernorm
    model.layers.L.mlp.{gate,up}_proj       decoder.layers.L.mlp.linear_fc1  (= [gate; up])
    model.layers.L.mlp.down_proj            decoder.layers.L.mlp.linear_fc2
    model.layers.L.mlp.gate                 decoder.layers.L.mlp.router
                  .gate.e_score_correction_bias             .router.expert_bias
                  .experts.E.{gate,up}_proj                 .experts.E.linear_fc1
                  .experts.E.down_proj                      .experts.E.linear_fc2
                  .shared_experts.*                         .shared_experts.linear_fc{1,2}
    model.norm                              decoder.final_layernorm
    lm_head                                 output_layer  (absent when tied)

MTP depth k is published as decoder layer index num_hidden_layers + k:
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` map to
`mtp.layers.k.{enorm,hnorm,eh_proj,final_layernorm}`, its decoder-layer
tensors to `mtp.layers.k.transformer_layer.*`, and its `embed_tokens` /
`shared_head.head` are copies of the main embedding / head (megatron-core
shares them). Both concatenate [enorm(embedding), hnorm(hidden)] before
`eh_proj` (megatron `MultiTokenPredictionLayer._concat_embeddings`, vLLM and
transformers `MtpLayer`), so `eh_proj` is copied unchanged.

RoPE layout: the published weights are "interleaved" (rope pairs are
adjacent dims), and megatron-core MLA de-interleaves q/k rope dims before
rotate-half (`_apply_rotary_pos_emb_bshd(multi_latent_attention=True)`),
exactly transformers' `apply_rotary_pos_emb_interleave`. So rows are copied
as they are; only an HF checkpoint with `rope_interleave: false` needs its
rope rows of q and kv_a permuted (`rope_rows_to_interleaved`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config.model import ModelConfig

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TensorMap:
    """One megatron tensor = its HF tensors concatenated along dim 0.

    `mcore` None means an HF tensor we write but do not store (a zero
    `e_score_correction_bias` for a model trained without expert bias).
    `rope` names the rope-row layout of the tensor: "q" (per head, the last
    qk_pos_emb_head_dim rows) or "kv" (the last qk_pos_emb_head_dim rows).
    """

    mcore: Optional[str]
    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]
    rope: Optional[str] = None

    @property
    def mcore_shape(self) -> Shape:
        rows = sum(s[0] for s in self.shapes)
        return (rows,) + tuple(self.shapes[0][1:])


def _attention(cfg: ModelConfig, hf: str, mc: str) -> list[TensorMap]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_rows = heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
    a, m = hf + "self_attn.", mc + "self_attention."
    maps = []
    if cfg.q_lora_rank:
        r = cfg.q_lora_rank
        maps += [
            TensorMap(m + "linear_q_down_proj.weight", (a + "q_a_proj.weight",), ((r, h),)),
            TensorMap(m + "q_layernorm.weight", (a + "q_a_layernorm.weight",), ((r,),)),
            TensorMap(m + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), ((q_rows, r),), rope="q"),
        ]
    else:
        maps.append(TensorMap(m + "linear_q_proj.weight", (a + "q_proj.weight",), ((q_rows, h),), rope="q"))
    kv = cfg.kv_lora_rank
    maps += [
        TensorMap(m + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",),
                  ((kv + cfg.qk_pos_emb_head_dim, h),), rope="kv"),
        TensorMap(m + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",), ((kv,),)),
        TensorMap(m + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",),
                  ((heads * (cfg.qk_head_dim + cfg.v_head_dim), kv),)),
        TensorMap(m + "linear_proj.weight", (a + "o_proj.weight",), ((h, heads * cfg.v_head_dim),)),
    ]
    return maps


def _swiglu(hf: str, mc: str, hidden: int, ffn: int) -> list[TensorMap]:
    return [
        TensorMap(mc + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                  ((ffn, hidden), (ffn, hidden))),
        TensorMap(mc + "linear_fc2.weight", (hf + "down_proj.weight",), ((hidden, ffn),)),
    ]


def _layer(cfg: ModelConfig, hf: str, mc: str, moe: bool) -> list[TensorMap]:
    h = cfg.hidden_size
    maps = [TensorMap(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), ((h,),))]
    maps += _attention(cfg, hf, mc)
    maps.append(TensorMap(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), ((h,),)))
    if not moe:
        return maps + _swiglu(hf + "mlp.", mc + "mlp.", h, cfg.ffn_hidden_size)
    e = cfg.num_experts
    maps.append(TensorMap(mc + "mlp.router.weight", (hf + "mlp.gate.weight",), ((e, h),)))
    bias = mc + "mlp.router.expert_bias" if cfg.moe_router_enable_expert_bias else None
    maps.append(TensorMap(bias, (hf + "mlp.gate.e_score_correction_bias",), ((e,),)))
    for i in range(e):
        maps += _swiglu(f"{hf}mlp.experts.{i}.", f"{mc}mlp.experts.{i}.", h, cfg.moe_ffn_hidden_size)
    if cfg.moe_shared_expert_intermediate_size:
        maps += _swiglu(hf + "mlp.shared_experts.", mc + "mlp.shared_experts.", h,
                        cfg.moe_shared_expert_intermediate_size)
    return maps


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    """All tensors of `cfg` in HF checkpoint order (embedding, layers, head, MTP)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), ((v, h),))]
    for i in range(cfg.num_layers):
        maps += _layer(cfg, f"model.layers.{i}.", f"decoder.layers.{i}.", i >= cfg.first_k_dense_layers)
    maps.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), ((h,),)))
    if cfg.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), ((v, h),)))
    for k in range(cfg.mtp_num_layers):
        hf, mc = f"model.layers.{cfg.num_layers + k}.", f"mtp.layers.{k}."
        maps += [
            TensorMap(mc + "enorm.weight", (hf + "enorm.weight",), ((h,),)),
            TensorMap(mc + "hnorm.weight", (hf + "hnorm.weight",), ((h,),)),
            TensorMap(mc + "eh_proj.weight", (hf + "eh_proj.weight",), ((h, 2 * h),)),
        ]
        maps += _layer(cfg, hf, mc + "transformer_layer.", cfg.num_moe_layers > 0)
        maps.append(TensorMap(mc + "final_layernorm.weight", (hf + "shared_head.norm.weight",), ((h,),)))
    return maps


def mtp_shared_copies(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(MTP-layer HF name, main-model HF name) pairs that hold the same tensor."""
    head = "lm_head.weight" if cfg.untie_embeddings_and_output_weights else "model.embed_tokens.weight"
    pairs = []
    for k in range(cfg.mtp_num_layers):
        hf = f"model.layers.{cfg.num_layers + k}."
        pairs += [(hf + "embed_tokens.weight", "model.embed_tokens.weight"),
                  (hf + "shared_head.head.weight", head)]
    return pairs


def hf_part(cfg: ModelConfig, m: TensorMap, i: int, full: Optional[torch.Tensor], interleaved: bool = True,
            dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """HF tensor `m.hf[i]`: rows of our tensor `full` (a zero expert-score bias where `m.mcore` is None),
    rope rows permuted for an HF layout that is not interleaved; a copy (safetensors refuses views that
    share one storage)."""
    if m.mcore is None:
        return torch.zeros(m.shapes[i], dtype=dtype or torch.float32)
    if m.rope and not interleaved:
        full = permute_rope_rows(cfg, m.rope, full, to_interleaved=False)
    start = sum(s[0] for s in m.shapes[:i])
    return full[start:start + m.shapes[i][0]].to(dtype or full.dtype, copy=True)


def hf_state_dict(cfg: ModelConfig, state: dict, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Our weights under checkpoint (global) names -> the published DeepSeek-V3 tensors (MTP copies
    included), in memory: what an inference server that loads Hugging Face names (vLLM, SGLang) takes.

    Args:
        state: {global name: tensor} (`checkpoint.state` names, e.g. `async_rl.gather.gather_policy`'s).
        dtype: cast every tensor (None: keep each one's).
    Raises ValueError naming a tensor the map needs that `state` lacks.
    """
    out = {}
    for m in tensor_maps(cfg):
        if m.mcore is not None and m.mcore not in state:
            raise ValueError(f"the weights have no {m.mcore} (the {cfg.num_layers}-layer model's map needs it); "
                             f"pass every parameter under its checkpoint name")
        full = None if m.mcore is None else state[m.mcore].detach()
        for i, name in enumerate(m.hf):
            out[name] = hf_part(cfg, m, i, full, dtype=dtype)
    for copy, main in mtp_shared_copies(cfg):
        out[copy] = out[main]
    return out


def _rope_row_index(cfg: ModelConfig, kind: str, rows: int, to_interleaved: bool) -> torch.Tensor:
    """Row permutation of a q or kv_a weight between the two rope layouts."""
    d = cfg.qk_pos_emb_head_dim
    # Interleaved row 2i holds non-interleaved row i, row 2i+1 holds row i + d/2.
    perm = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).flatten()
    if not to_interleaved:
        perm = torch.argsort(perm)
    index = torch.arange(rows)
    if kind == "q":
        per_head = cfg.qk_head_dim + d
        index = index.view(-1, per_head)
        index[:, cfg.qk_head_dim:] = index[:, cfg.qk_head_dim:][:, perm]
        return index.flatten()
    index[rows - d:] = index[rows - d:][perm]
    return index


def permute_rope_rows(cfg: ModelConfig, kind: str, weight: torch.Tensor, to_interleaved: bool) -> torch.Tensor:
    """Convert rope rows between HF's `rope_interleave: false` layout and the
    interleaved layout megatron-core uses.

    Args:
        kind: "q" ([heads * (nope + rope), in]) or "kv" ([kv_lora + rope, in]).
        weight: the HF/megatron weight, rows first.
    """
    return weight[_rope_row_index(cfg, kind, weight.shape[0], to_interleaved)]
