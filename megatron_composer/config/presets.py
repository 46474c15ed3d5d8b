"""Model presets: `tiny` (CPU), `tiny-vllm` (CPU, servable by vLLM's CPU build), `small` (one GPU),
`deepseek-v3`, `kimi-k2.5`.

The full-size presets are the published architectures; on CPU they are only
ever used as configs (parameter counts, memory plans), never materialized.
"""
from __future__ import annotations

from .model import ModelConfig, YarnConfig

PRESETS: dict[str, ModelConfig] = {
    # A few M parameters: every architectural feature of the real model
    # (q LoRA, group-limited sigmoid routing with expert bias, shared expert,
    # dense first layer, MTP) at a size that trains in seconds on a laptop.
    "tiny": ModelConfig(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        vocab_size=4096,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_head_dim=32,
        qk_pos_emb_head_dim=16,
        v_head_dim=32,
        ffn_hidden_size=384,
        first_k_dense_layers=1,
        num_experts=8,
        moe_ffn_hidden_size=96,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=96,
        # 2 groups, 1 chosen: each group scored by its top-2 experts, as
        # DeepSeek-V3 does (megatron scores by top topk/group_topk).
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        mtp_num_layers=1,
        max_position_embeddings=4096,
        init_method_std=0.02,
    ),
    # `tiny` with the MLA sizes vLLM's CPU decode kernel takes (kv_lora_rank + rope dim = 576, as in
    # DeepSeek-V3): the model the vLLM rollout backend is tested with on CPU (about 6M parameters).
    "tiny-vllm": ModelConfig(
        num_layers=3,
        hidden_size=256,
        num_attention_heads=4,
        vocab_size=4096,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_head_dim=32,
        qk_pos_emb_head_dim=64,
        v_head_dim=32,
        ffn_hidden_size=512,
        first_k_dense_layers=1,
        num_experts=8,
        moe_ffn_hidden_size=128,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=128,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        mtp_num_layers=1,
        max_position_embeddings=4096,
        init_method_std=0.02,
    ),
    # About 1B total parameters: fits and trains on one GPU.
    "small": ModelConfig(
        num_layers=12,
        hidden_size=1024,
        num_attention_heads=16,
        vocab_size=32768,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_head_dim=64,
        qk_pos_emb_head_dim=32,
        v_head_dim=64,
        ffn_hidden_size=2816,
        first_k_dense_layers=1,
        num_experts=64,
        moe_ffn_hidden_size=512,
        moe_router_topk=6,
        moe_shared_expert_intermediate_size=1024,
        moe_router_num_groups=8,
        moe_router_group_topk=3,
        moe_router_topk_scaling_factor=2.5,
        mtp_num_layers=1,
        max_position_embeddings=32768,
        init_method_std=0.01,
    ),
    "deepseek-v3": ModelConfig(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        vocab_size=129280,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        ffn_hidden_size=18432,
        first_k_dense_layers=3,
        num_experts=256,
        moe_ffn_hidden_size=2048,
        moe_router_topk=8,
        moe_shared_expert_intermediate_size=2048,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5,
        mtp_num_layers=1,
        max_position_embeddings=163840,
        yarn=YarnConfig(factor=40.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    ),
    "kimi-k2.5": ModelConfig(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=64,
        vocab_size=163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        ffn_hidden_size=18432,
        first_k_dense_layers=1,
        num_experts=384,
        moe_ffn_hidden_size=2048,
        moe_router_topk=8,
        moe_shared_expert_intermediate_size=2048,
        moe_router_num_groups=1,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.827,
        mtp_num_layers=0,
        max_position_embeddings=262144,
        rotary_base=50000.0,
        yarn=YarnConfig(factor=64.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
