"""Hugging Face DeepSeek-V3 / Kimi-K2 `config.json` <-> our `ModelConfig`.

Both directions refuse what the other side cannot compute identically, and
name the key. The rules come from reading megatron-core 0.16.1
(`moe_utils.topk_routing_with_score_function`, `YarnRotaryEmbedding`,
`MLASelfAttention`) next to transformers' `modeling_deepseek_v3`:

* routing: sigmoid scores, `e_score_correction_bias` added for selection only,
  weights gathered from the unbiased scores, normalized over the top-k, times
  `routed_scaling_factor` -- the same in both, except that
  - megatron scores a group by the sum of its top `topk // group_topk`
    experts, DeepSeek by its top 2, so group-limited routing with
    `n_group > topk_group` needs `num_experts_per_tok // topk_group == 2`;
  - megatron always normalizes for top-k > 1 and never for top-1, so
    `norm_topk_prob` must be `num_experts_per_tok > 1`;
* YaRN: megatron's cos/sin factor is mscale(f, mscale) / mscale(f, mscale_all_dim)
  and its softmax scale mscale(f, mscale_all_dim)^2 / sqrt(d): the same as
  transformers whenever both mscales are set, or mscale_all_dim is unset and
  mscale is 1; correction bounds are always rounded (`truncate`);
* the latent RMSNorms (`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 in
  transformers and `rms_norm_eps` in megatron: identical for the published
  configs (1e-6).

The HF config a checkpoint came with is kept in our `meta.json` (`hf_config`)
so that export writes back the fields we do not model (token ids, ...).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from ..config.model import ModelConfig, YarnConfig, model_config_from_dict  # noqa: F401 (re-exported)


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted exactly; names the key."""


_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# Derived or superseded fields of a stored HF config that export rewrites.
_DROPPED_ON_EXPORT = ("quantization_config", "rope_parameters", "torch_dtype", "dtype", "transformers_version",
                      "head_dim", "qk_head_dim")


def _get(hf: dict, key: str, default=None):
    value = hf.get(key, default)
    return default if value is None else value


def _rope_dict(hf: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling dict or None) from either the published `rope_scaling`
    + `rope_theta` style or transformers 5's `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise ConversionError(
            f"rope_scaling.type={kind!r} is not supported; megatron-core MLA implements "
            "plain RoPE and 'yarn' only"
        )
    return float(theta), dict(scaling)


def _yarn_from_hf(scaling: dict, max_positions: int) -> YarnConfig:
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ConversionError("rope_scaling.original_max_position_embeddings is required for yarn")
    factor = scaling.get("factor") or max_positions / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim") or 0.0
    if mscale_all_dim and not mscale:
        raise ConversionError(
            f"rope_scaling.mscale={mscale!r} with mscale_all_dim={mscale_all_dim}: transformers then "
            "scales cos/sin by mscale(factor, 1) alone, which megatron-core's YaRN cannot express"
        )
    if not mscale_all_dim and mscale not in (None, 1, 1.0):
        raise ConversionError(
            f"rope_scaling.mscale={mscale} without mscale_all_dim: transformers ignores it, "
            "megatron-core would apply it; set mscale to 1"
        )
    if scaling.get("attention_factor") is not None:
        raise ConversionError("rope_scaling.attention_factor is not supported by megatron-core's YaRN")
    if scaling.get("truncate", True) is False:
        raise ConversionError("rope_scaling.truncate=false is not supported: megatron-core rounds "
                              "the YaRN correction range")
    return YarnConfig(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(mscale or 1.0),
        mscale_all_dim=float(mscale_all_dim),
    )


def _check_routing(topk: int, groups: Optional[int], group_topk: Optional[int], norm_topk_prob: bool,
                   names=("num_experts_per_tok", "topk_group", "norm_topk_prob")) -> None:
    if groups and group_topk and group_topk < groups and topk // group_topk != 2:
        raise ConversionError(
            f"{names[0]}={topk} with {names[1]}={group_topk} (of {groups} groups): megatron-core scores "
            f"a group by its top {topk // group_topk} experts, DeepSeek-V3 by its top 2; "
            f"only {names[0]} // {names[1]} == 2 (or selecting all groups) converts exactly"
        )
    if norm_topk_prob != (topk > 1):
        raise ConversionError(
            f"{names[2]}={norm_topk_prob} with {names[0]}={topk}: megatron-core normalizes the "
            "top-k weights exactly when top-k > 1"
        )


def _check_supported(hf: dict) -> None:
    if hf.get("model_type", "deepseek_v3") not in _MODEL_TYPES:
        raise ConversionError(f"model_type={hf['model_type']!r}; this converter reads the DeepSeek-V3 "
                              f"architecture ({', '.join(_MODEL_TYPES)})")
    if "text_config" in hf:
        raise ConversionError("config has a text_config (a multimodal wrapper such as Kimi-K2.5); map its "
                              "text_config (hf_to_mcore reads the wrapper and its language_model. tensors)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "intermediate_size"):
        if hf.get(key) is None:
            raise ConversionError(f"config.json lacks {key}")
    if hf.get("attention_bias"):
        raise ConversionError("attention_bias=true is not supported: megatron-core MLA has no "
                              "attention biases here (add_bias_linear=False)")
    if _get(hf, "hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    if _get(hf, "moe_layer_freq", 1) != 1:
        raise ConversionError(f"moe_layer_freq={hf['moe_layer_freq']}; only 1 (every layer after "
                              "first_k_dense_replace is MoE) is supported")


def _check_router(hf: dict, scoring: str) -> None:
    """The HF router must be one megatron-core's computes identically."""
    if scoring not in ("sigmoid", "softmax"):
        raise ConversionError(f"scoring_func={scoring!r}; megatron-core supports 'sigmoid' and 'softmax'")
    topk = int(_get(hf, "num_experts_per_tok", 1))
    groups, group_topk = hf.get("n_group"), hf.get("topk_group")
    norm_topk_prob = bool(_get(hf, "norm_topk_prob", scoring == "sigmoid"))
    topk_method = _get(hf, "topk_method", "noaux_tc" if scoring == "sigmoid" else "greedy")
    if scoring == "sigmoid":
        if topk_method != "noaux_tc":
            raise ConversionError(f"topk_method={topk_method!r} with sigmoid scores; "
                                  "DeepSeek-V3 routing is 'noaux_tc'")
        _check_routing(topk, groups, group_topk, norm_topk_prob)
    # megatron's softmax path (softmax, top-k, no renormalization) is DeepSeek-V2's
    # 'greedy'; its group-limited variant scores groups by their best expert.
    elif topk_method != "greedy" or norm_topk_prob or (groups and group_topk and group_topk < groups):
        raise ConversionError(
            f"scoring_func='softmax' converts only with topk_method='greedy', "
            f"norm_topk_prob=false and no group limit (got topk_method={topk_method!r}, "
            f"norm_topk_prob={norm_topk_prob}, n_group={groups}, topk_group={group_topk})"
        )


def model_config_from_hf(hf: dict, mtp_layers: Optional[int] = None) -> ModelConfig:
    """Our ModelConfig for an HF DeepSeek-V3 / Kimi-K2 config dict.

    Args:
        hf: the parsed config.json.
        mtp_layers: MTP depth actually present in the weights (None: trust
            `num_nextn_predict_layers`).
    """
    _check_supported(hf)
    scoring = _get(hf, "scoring_func", "sigmoid")
    num_layers = int(hf["num_hidden_layers"])
    experts = _get(hf, "n_routed_experts", 0)
    first_dense = min(int(_get(hf, "first_k_dense_replace", 0)), num_layers) if experts else num_layers
    if first_dense < num_layers:
        _check_router(hf, scoring)
    groups, group_topk = hf.get("n_group"), hf.get("topk_group")
    moe_ffn = int(_get(hf, "moe_intermediate_size", 0))
    theta, scaling = _rope_dict(hf)
    max_positions = int(_get(hf, "max_position_embeddings", 4096))
    mtp = int(_get(hf, "num_nextn_predict_layers", 0)) if mtp_layers is None else mtp_layers
    if mtp and first_dense == num_layers:
        raise ConversionError(f"num_nextn_predict_layers={mtp} in a model without MoE layers: "
                              "DeepSeek's MTP layers are MoE, ours would be dense")
    cfg = ModelConfig(
        num_layers=num_layers,
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=int(hf["num_attention_heads"]),
        vocab_size=int(hf["vocab_size"]),
        q_lora_rank=hf.get("q_lora_rank") or None,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_head_dim=int(hf["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        ffn_hidden_size=int(hf["intermediate_size"]),
        first_k_dense_layers=first_dense,
        num_experts=int(experts),
        moe_ffn_hidden_size=moe_ffn,
        moe_router_topk=int(_get(hf, "num_experts_per_tok", 1)),
        moe_shared_expert_intermediate_size=int(_get(hf, "n_shared_experts", 0)) * moe_ffn,
        moe_router_num_groups=int(groups) if groups else None,
        moe_router_group_topk=int(group_topk) if groups and group_topk else None,
        moe_router_topk_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
        moe_router_score_function=scoring,
        moe_router_enable_expert_bias=scoring == "sigmoid",
        mtp_num_layers=mtp,
        max_position_embeddings=max_positions,
        rotary_base=theta,
        yarn=_yarn_from_hf(scaling, max_positions) if scaling else None,
        norm_epsilon=float(_get(hf, "rms_norm_eps", 1e-6)),
        untie_embeddings_and_output_weights=not bool(_get(hf, "tie_word_embeddings", False)),
        init_method_std=float(_get(hf, "initializer_range", 0.02)),
    )
    try:
        cfg.validate()
    except ValueError as exc:
        raise ConversionError(f"config.json maps to an invalid model: {exc}") from None
    return cfg


def hf_config_from_model(cfg: ModelConfig, base: Optional[dict] = None, dtype: str = "bfloat16",
                         rope_interleave: bool = True) -> dict:
    """An HF DeepSeek-V3 config.json dict for `cfg`.

    `base` (the config the checkpoint was imported from, if any) supplies the
    fields we do not model; every field we do model is overwritten. Written in
    the published style (`rope_theta` + `rope_scaling`), which transformers,
    vLLM and SGLang all read.
    """
    moe = cfg.num_moe_layers > 0
    if moe:
        names = ("moe_router_topk", "moe_router_group_topk", "normalization of top-k > 1")
        _check_routing(cfg.moe_router_topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk,
                       cfg.moe_router_topk > 1, names)
        if cfg.moe_router_score_function != "sigmoid":
            raise ConversionError(
                f"moe_router_score_function={cfg.moe_router_score_function!r}: the DeepSeek-V3 "
                "format routes with sigmoid scores"
            )
        if cfg.moe_ffn_hidden_size and cfg.moe_shared_expert_intermediate_size % cfg.moe_ffn_hidden_size:
            raise ConversionError(
                f"moe_shared_expert_intermediate_size={cfg.moe_shared_expert_intermediate_size} is not "
                f"a multiple of moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} (HF counts n_shared_experts)"
            )
    elif cfg.mtp_num_layers:
        raise ConversionError(f"mtp_num_layers={cfg.mtp_num_layers} without MoE layers: DeepSeek's "
                              "MTP layers are MoE layers")
    hf = {k: v for k, v in (base or {}).items() if k not in _DROPPED_ON_EXPORT}
    hf.setdefault("architectures", ["DeepseekV3ForCausalLM"])
    hf.setdefault("model_type", "deepseek_v3")
    yarn = None
    if cfg.yarn:
        yarn = {"type": "yarn", "rope_type": "yarn", **asdict(cfg.yarn)}
    groups = cfg.moe_router_num_groups or 1
    hf.update(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_nextn_predict_layers=cfg.mtp_num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=(cfg.moe_shared_expert_intermediate_size // cfg.moe_ffn_hidden_size
                          if cfg.moe_ffn_hidden_size else 0),
        n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.moe_router_topk_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_head_dim,
        topk_method="noaux_tc",
        n_group=groups,
        topk_group=cfg.moe_router_group_topk or groups,
        num_experts_per_tok=cfg.moe_router_topk,
        moe_layer_freq=1,
        first_k_dense_replace=cfg.first_k_dense_layers,
        norm_topk_prob=cfg.moe_router_topk > 1,
        scoring_func="sigmoid",
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        rope_theta=cfg.rotary_base,
        rope_scaling=yarn,
        rope_interleave=rope_interleave,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=cfg.init_method_std,
        torch_dtype=dtype,
    )
    return hf
