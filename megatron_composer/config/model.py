"""Model architecture config for the Composer family (DeepSeek-V3 / Kimi K2.5).

`ModelConfig` is the one description of an architecture: presets are values
of it, the CLI overrides its fields, `models.build_model` turns it into a
megatron-core `MLATransformerConfig`, and `parameter_inventory` lists its
parameter tensors without building anything (so the 1T presets can be
planned on a laptop); `count_parameters` is their sum, the one parameter count.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Optional


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (DeepSeek-V3 / Kimi `rope_scaling` with type "yarn")."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of an MLA + MoE + MTP decoder.

    Field names follow megatron-core's `MLATransformerConfig` where it has
    the concept, so the mapping in `models.builder` is mostly one-to-one.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    # MLA. q_lora_rank None means a plain (full-rank) q projection.
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int  # the "nope" part of each query/key head
    qk_pos_emb_head_dim: int  # the rope part, shared by all key heads
    v_head_dim: int
    # FFN: the first `first_k_dense_layers` layers are dense SwiGLU, the rest MoE.
    ffn_hidden_size: int
    first_k_dense_layers: int
    num_experts: int
    moe_ffn_hidden_size: int
    moe_router_topk: int
    moe_shared_expert_intermediate_size: int  # 0 disables the shared expert
    moe_router_num_groups: Optional[int] = None  # group-limited routing
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: float = 1.0
    moe_router_score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True  # aux-loss-free balancing
    moe_router_bias_update_rate: float = 1e-3
    # MTP: number of extra next-next-token modules (0 disables MTP).
    mtp_num_layers: int = 1
    # Positions and norms.
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    yarn: Optional[YarnConfig] = None
    norm_epsilon: float = 1e-6
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.006

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        if not 0 <= self.first_k_dense_layers <= self.num_layers:
            raise ValueError(
                f"first_k_dense_layers={self.first_k_dense_layers} must be within "
                f"[0, num_layers={self.num_layers}]"
            )
        if self.num_moe_layers > 0 and self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} exceeds num_experts="
                f"{self.num_experts}; lower --moe-router-topk or add experts"
            )
        groups = self.moe_router_num_groups
        if groups:
            if self.num_experts % groups:
                raise ValueError(
                    f"num_experts={self.num_experts} is not divisible by "
                    f"moe_router_num_groups={groups}"
                )
            if not self.moe_router_group_topk or self.moe_router_group_topk > groups:
                raise ValueError(
                    f"moe_router_group_topk={self.moe_router_group_topk} must be in "
                    f"[1, moe_router_num_groups={groups}]"
                )
        if self.moe_router_score_function not in ("sigmoid", "softmax"):
            raise ValueError(
                f"moe_router_score_function={self.moe_router_score_function!r}; "
                "use 'sigmoid' or 'softmax'"
            )
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even")


# ---------------------------------------------------------------- parameters
# `parameter_inventory` lists every parameter tensor of one expert-parallel
# rank's GPTModel exactly as `models.build_model` names and shapes them with
# megatron-core 0.16.1's local spec (`decoder.layers.{i}.`, MTP's
# `mtp.layers.{k}.transformer_layer.`, routed experts as
# `mlp.experts.local_experts.{e}.` with e < num_experts / EP), and the FSDP2
# unit each belongs to under dual-mesh HSDP (`parallel.fsdp`: one
# `fully_shard` per routed-experts module, per decoder/MTP layer, and for the
# embedding, the output layer and the final norm). Transformer Engine's spec
# fuses some of these tensors under other names, with the same number of
# elements in the same units. `count_parameters` sums it; the planner sizes
# states and collectives from it. `tests/test_plan.py` checks names and shapes
# against a built tiny model, `tests/test_model.py` the counts.

@dataclass(frozen=True)
class ParamEntry:
    """One parameter tensor of one rank."""

    name: str
    shape: tuple[int, ...]
    unit: str  # the module `fully_shard` is applied to under HSDP
    expert: bool  # a routed expert's weight (EP-split; sharded over the expert-data-parallel ranks)

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _attention(c: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_head_dim + c.qk_pos_emb_head_dim
    a = prefix + "self_attention."
    out = [(prefix + "input_layernorm.weight", (h,)), (a + "linear_proj.weight", (h, heads * c.v_head_dim))]
    if c.q_lora_rank:
        out += [(a + "linear_q_down_proj.weight", (c.q_lora_rank, h)),
                (a + "linear_q_up_proj.weight", (heads * qk, c.q_lora_rank))]
    else:
        out.append((a + "linear_q_proj.weight", (heads * qk, h)))
    out += [(a + "linear_kv_down_proj.weight", (c.kv_lora_rank + c.qk_pos_emb_head_dim, h)),
            (a + "linear_kv_up_proj.weight", (heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank))]
    if c.q_lora_rank:
        out.append((a + "q_layernorm.weight", (c.q_lora_rank,)))
    out += [(a + "kv_layernorm.weight", (c.kv_lora_rank,)), (prefix + "pre_mlp_layernorm.weight", (h,))]
    return out


def _layer(c: ModelConfig, prefix: str, moe: bool, ep: int) -> list[ParamEntry]:
    """A transformer layer, in the model's order: its dense tensors in unit `prefix`,
    routed experts in unit `prefix + mlp.experts`."""
    unit, experts_unit = prefix.rstrip("."), prefix + "mlp.experts"
    h, m = c.hidden_size, prefix + "mlp."
    out = [ParamEntry(n, s, unit, False) for n, s in _attention(c, prefix)]
    if not moe:
        return out + [ParamEntry(m + "linear_fc1.weight", (2 * c.ffn_hidden_size, h), unit, False),
                      ParamEntry(m + "linear_fc2.weight", (h, c.ffn_hidden_size), unit, False)]
    out.append(ParamEntry(m + "router.weight", (c.num_experts, h), unit, False))
    f = c.moe_ffn_hidden_size
    for e in range(c.num_experts // ep):
        out += [ParamEntry(f"{m}experts.local_experts.{e}.linear_fc1.weight", (2 * f, h), experts_unit, True),
                ParamEntry(f"{m}experts.local_experts.{e}.linear_fc2.weight", (h, f), experts_unit, True)]
    s = c.moe_shared_expert_intermediate_size
    if s:
        out += [ParamEntry(m + "shared_experts.linear_fc1.weight", (2 * s, h), unit, False),
                ParamEntry(m + "shared_experts.linear_fc2.weight", (h, s), unit, False)]
    return out


@lru_cache(maxsize=16)
def parameter_inventory(c: ModelConfig, ep: int = 1) -> tuple[ParamEntry, ...]:
    """The trainable parameters of one EP rank of `build_model(c)` (local spec, TP = PP = 1).

    Raises ValueError if EP does not divide the experts.
    """
    if c.num_moe_layers and c.num_experts % ep:
        raise ValueError(f"EP={ep} does not divide the {c.num_experts} experts")
    h, v = c.hidden_size, c.vocab_size
    out = [ParamEntry("embedding.word_embeddings.weight", (v, h), "embedding", False)]
    for i in range(c.num_layers):
        out += _layer(c, f"decoder.layers.{i}.", i >= c.first_k_dense_layers, ep)
    out.append(ParamEntry("decoder.final_layernorm.weight", (h,), "decoder.final_layernorm", False))
    last_is_moe = c.num_moe_layers > 0
    for k in range(c.mtp_num_layers):
        p = f"mtp.layers.{k}."
        unit = p.rstrip(".")
        out += [ParamEntry(p + "enorm.weight", (h,), unit, False), ParamEntry(p + "hnorm.weight", (h,), unit, False),
                ParamEntry(p + "eh_proj.weight", (h, 2 * h), unit, False)]
        layer = _layer(c, p + "transformer_layer.", last_is_moe, ep)
        out += [e if e.expert else ParamEntry(e.name, e.shape, unit, False) for e in layer]
        out.append(ParamEntry(p + "final_layernorm.weight", (h,), unit, False))
    if c.untie_embeddings_and_output_weights:
        out.append(ParamEntry("output_layer.weight", (v, h), "output_layer", False))
    return tuple(out)


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts in elements. `active` is what one token touches."""

    total: int
    active: int
    mtp: int = field(default=0)  # MTP parameters, not included in total/active
    mtp_active: int = field(default=0)  # what one token touches in the MTP modules


def _expert_bias(c: ModelConfig, moe_layers: int) -> int:
    """The routers' expert bias: counted, as the published totals do, though megatron-core
    keeps it as a buffer rather than a parameter."""
    return moe_layers * c.num_experts if c.moe_router_enable_expert_bias else 0


def _active(c: ModelConfig, entries) -> int:
    """Elements one token touches: all but the routed experts, of which top-k of each layer's."""
    total = sum(e.numel for e in entries)
    routed = sum(e.numel for e in entries if e.expert)
    if not routed:
        return total
    return total - routed + routed // c.num_experts * c.moe_router_topk


def count_parameters(c: ModelConfig) -> ParameterCount:
    """Total and active parameters of the main model: the sums of `parameter_inventory(c)`.

    Counted the way DeepSeek-V3 and Kimi K2 report them: embeddings and the
    output head are included in both numbers, as is the routers' expert bias
    (a buffer in megatron-core); MTP modules in neither (they are reported
    separately in `mtp` and `mtp_active`).
    """
    inventory = parameter_inventory(c)
    main = [e for e in inventory if not e.name.startswith("mtp.")]
    mtp = [e for e in inventory if e.name.startswith("mtp.")]
    bias = _expert_bias(c, c.num_moe_layers)
    mtp_bias = _expert_bias(c, c.mtp_num_layers) if c.num_moe_layers else 0
    return ParameterCount(total=sum(e.numel for e in main) + bias, active=_active(c, main) + bias,
                          mtp=sum(e.numel for e in mtp) + mtp_bias, mtp_active=_active(c, mtp) + mtp_bias)


def training_flops_per_token(c: ModelConfig, seq_length: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward).

    Matmul FLOPs are 2 per active weight that a token multiplies (the
    embedding lookup is not a matmul; an MTP module's three own norms are left
    out, the other norms and biases are counted as weights); causal attention
    adds QK^T and AV over an average context of seq_length / 2 per layer (MTP
    layers included).
    """
    params = count_parameters(c)
    matmul_weights = params.active - c.vocab_size * c.hidden_size - c.hidden_size
    matmul_weights += params.mtp_active - c.mtp_num_layers * 3 * c.hidden_size
    layers = c.num_layers + c.mtp_num_layers
    qk = c.qk_head_dim + c.qk_pos_emb_head_dim
    attention = 2 * c.num_attention_heads * (qk + c.v_head_dim) * (seq_length / 2) * layers
    return 3.0 * (2.0 * matmul_weights + attention)


def model_config_from_dict(d: dict) -> ModelConfig:
    """Inverse of `dataclasses.asdict(ModelConfig)`, as stored in a checkpoint's meta.json."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"model_config has fields this version does not know: {unknown}; "
                         "the checkpoint was written by a newer version")
    d = dict(d)
    if d.get("yarn") is not None:
        d["yarn"] = YarnConfig(**d["yarn"])
    return ModelConfig(**d)
