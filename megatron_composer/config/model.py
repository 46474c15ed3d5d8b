"""Model architecture config for the Composer family (DeepSeek-V3 / Kimi K2.5).

`ModelConfig` is the one description of an architecture: presets are values
of it, the CLI overrides its fields, `models.build_model` turns it into a
megatron-core `MLATransformerConfig`, and `count_parameters` sizes it without
building anything (so the 1T presets can be planned on a laptop).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts in elements. `active` is what one token touches."""

    total: int
    active: int
    mtp: int = field(default=0)  # MTP parameters, not included in total/active


def _attention_params(c: ModelConfig) -> int:
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_head_dim + c.qk_pos_emb_head_dim
    if c.q_lora_rank:
        q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk
    else:
        q = h * heads * qk
    kv = h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank
    kv += c.kv_lora_rank * heads * (c.qk_head_dim + c.v_head_dim)
    out = heads * c.v_head_dim * h
    return q + kv + out + 2 * h  # + input and pre-FFN norms


def _moe_params(c: ModelConfig, experts: int) -> int:
    h = c.hidden_size
    routed = experts * 3 * h * c.moe_ffn_hidden_size
    shared = 3 * h * c.moe_shared_expert_intermediate_size
    router = c.num_experts * h + (c.num_experts if c.moe_router_enable_expert_bias else 0)
    return routed + shared + router


def count_parameters(c: ModelConfig) -> ParameterCount:
    """Total and active parameters of the main model, computed from the config.

    Counted the way DeepSeek-V3 and Kimi K2 report them: embeddings and the
    output head are included in both numbers, MTP modules in neither (they
    are reported separately in `mtp`).
    """
    h = c.hidden_size
    attention = _attention_params(c)
    dense_layer = attention + 3 * h * c.ffn_hidden_size
    moe_total = attention + _moe_params(c, c.num_experts)
    moe_active = attention + _moe_params(c, c.moe_router_topk)
    embeddings = c.vocab_size * h * (2 if c.untie_embeddings_and_output_weights else 1) + h
    dense = c.first_k_dense_layers * dense_layer
    total = dense + c.num_moe_layers * moe_total + embeddings
    active = dense + c.num_moe_layers * moe_active + embeddings
    # An MTP module: two input norms, the 2h -> h projection, one MoE layer and
    # a final norm; it shares the embedding and output head with the model.
    mtp_layer = 2 * h + 2 * h * h + moe_total + h
    return ParameterCount(total=total, active=active, mtp=c.mtp_num_layers * mtp_layer)


def training_flops_per_token(c: ModelConfig, seq_length: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward).

    Matmul FLOPs are 2 per active weight that a token multiplies (the
    embedding lookup is not a matmul); causal attention adds QK^T and AV over
    an average context of seq_length / 2 per layer (MTP layers included).
    """
    params = count_parameters(c)
    matmul_weights = params.active - c.vocab_size * c.hidden_size - c.hidden_size
    if c.mtp_num_layers:
        # an MTP module: eh_proj + one MoE layer with top-k experts
        moe_active = _attention_params(c) + _moe_params(c, c.moe_router_topk)
        matmul_weights += c.mtp_num_layers * (2 * c.hidden_size**2 + moe_active)
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
