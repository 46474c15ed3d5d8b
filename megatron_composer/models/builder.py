"""Build the Composer model: a megatron-core `GPTModel` from our layer specs.

We start from megatron-core's local (non-TE) MLA layer spec and hand it our
own submodules where the recipe needs them; no megatron-core class is forked:

* core attention: `attention.MLACoreAttention` (megatron-core 0.16.1 has MLA
  core attention only through Transformer Engine);
* with context_parallel_size > 1, `attention.cp.ContextParallelMLASelfAttention`
  (KV latents all-gathered over CP, zigzag queries; no TE ring);
* first-k dense SwiGLU layers, then MoE layers with a shared expert, sigmoid
  scores, aux-loss-free expert bias, group-limited top-k and a routed scaling
  factor (all megatron-core router features, switched on by the config);
* an MTP block built from the last decoder layer's spec, as DeepSeek-V3;
* routed experts in the model's dtype (`moe_expert_precision` "bf16", the
  default): `moe.GroupedSequentialMLP`, megatron's SequentialMLP with one
  grouped GEMM per linear over all local experts (`grouped_experts=False`
  keeps megatron's per-expert loop);
* with `moe_expert_precision` nvfp4/mxfp8, `moe.QuantizedSequentialMLP`
  experts (megatron's SequentialMLP, expert GEMMs through `quantized_linear`);
  with `moe_dispatch_precision` mxfp8, `moe.MXFP8DispatchMoELayer` (alltoall
  dispatch payload in MXFP8, combine in BF16).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig

from ..attention.core import MLACoreAttention
from ..attention.cp import ContextParallelMLASelfAttention, ZigzagCoreAttention
from ..config.model import ModelConfig
from ..moe import grouped_experts_spec, quantized_dispatch_spec, quantized_experts_spec
from ..parallel.layout import ParallelLayout


def transformer_config(
    cfg: ModelConfig,
    layout: Optional[ParallelLayout] = None,
    params_dtype: torch.dtype = torch.float32,
    mtp_loss_scaling_factor: float = 0.1,
    **overrides,
) -> MLATransformerConfig:
    """Map a `ModelConfig` and a parallel layout (default: one rank) onto
    megatron-core's `MLATransformerConfig`."""
    cfg.validate()
    layout = layout or ParallelLayout(world_size=1)
    yarn = cfg.yarn
    moe = cfg.num_moe_layers > 0
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_head_dim,
        qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_layernorm=True,  # MLA's q/kv latent RMSNorms
        rope_type="yarn" if yarn else "rope",
        rotary_base=cfg.rotary_base,
        rotary_scaling_factor=yarn.factor if yarn else 1.0,
        original_max_position_embeddings=(
            yarn.original_max_position_embeddings if yarn else cfg.max_position_embeddings
        ),
        beta_fast=yarn.beta_fast if yarn else 32.0,
        beta_slow=yarn.beta_slow if yarn else 1.0,
        mscale=yarn.mscale if yarn else 1.0,
        mscale_all_dim=yarn.mscale_all_dim if yarn else 0.0,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # Fusions are CUDA kernels (or TE); the plain paths are exact everywhere.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        mtp_num_layers=cfg.mtp_num_layers or None,
        mtp_loss_scaling_factor=mtp_loss_scaling_factor,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        pipeline_model_parallel_size=layout.pp,
        sequence_parallel=layout.tp > 1,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if moe:
        kwargs.update(
            num_moe_experts=cfg.num_experts,
            moe_layer_freq=[0] * cfg.first_k_dense_layers + [1] * cfg.num_moe_layers,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or None,
            moe_router_topk=cfg.moe_router_topk,
            moe_router_score_function=cfg.moe_router_score_function,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
            moe_router_num_groups=cfg.moe_router_num_groups,
            moe_router_group_topk=cfg.moe_router_group_topk,
            moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
            moe_router_pre_softmax=cfg.moe_router_score_function == "softmax",
            # Aux-loss-free balancing through the expert bias, as DeepSeek-V3.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def _use_our_attention(layer_spec: ModuleSpec, context_parallel: bool) -> None:
    attention = layer_spec.submodules.self_attention
    assert attention.module is MLASelfAttention, attention.module
    if context_parallel:
        # CP: latent all-gather + zigzag queries (attention/cp.py), not TE's ring.
        attention.module = ContextParallelMLASelfAttention
        attention.submodules.core_attention = ZigzagCoreAttention
    else:
        attention.submodules.core_attention = MLACoreAttention


def _use_our_moe(layer_spec: ModuleSpec, expert_precision: str, dispatch_precision: str,
                 pg_collection=None, grouped_experts: bool = True) -> None:
    mlp = layer_spec.submodules.mlp
    if mlp.module is not MoELayer:  # a dense layer
        return
    experts = quantized_experts_spec(mlp.submodules.experts, expert_precision)
    if expert_precision == "bf16" and grouped_experts:
        experts = grouped_experts_spec(experts)
    mlp.submodules.experts = experts
    layer_spec.submodules.mlp = quantized_dispatch_spec(mlp, dispatch_precision, pg_collection)


def composer_block_spec(tconfig: MLATransformerConfig, moe_expert_precision: str = "bf16",
                        moe_dispatch_precision: str = "bf16", pg_collection=None,
                        grouped_experts: bool = True):
    """Decoder block spec: megatron-core's local MLA spec with our (CP) attention and experts."""
    block = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=False, normalization="RMSNorm")
    # Layer specs are shared objects between layers of the same kind; copy
    # before editing so megatron-core's module-level specs stay untouched.
    block.layer_specs = [_copy_spec(spec) for spec in block.layer_specs]
    for spec in block.layer_specs:
        _use_our_attention(spec, tconfig.context_parallel_size > 1)
        _use_our_moe(spec, moe_expert_precision, moe_dispatch_precision, pg_collection, grouped_experts)
    return block


def _copy_spec(spec):
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=_copy_spec(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(
            spec, **{f.name: _copy_spec(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        )
    return spec


def build_model(
    cfg: ModelConfig,
    layout: Optional[ParallelLayout] = None,
    params_dtype: torch.dtype = torch.float32,
    seq_length: Optional[int] = None,
    pg_collection=None,
    moe_expert_precision: str = "bf16",
    moe_dispatch_precision: str = "bf16",
    grouped_experts: bool = True,
    **config_overrides,
) -> GPTModel:
    """Build the Composer GPTModel on the current device.

    moe_expert_precision: "bf16" (unquantized: the experts run in the model's
    dtype, fp32 when `params_dtype` is fp32), "mxfp8" or "nvfp4" (NVFP4
    forward, MXFP8 backward); moe_dispatch_precision: "bf16" or "mxfp8" (EP
    dispatch payload). See `megatron_composer.moe`. grouped_experts: the
    unquantized experts as `GroupedSequentialMLP` (one grouped GEMM per
    linear); False gives megatron's SequentialMLP (same parameters).

    Needs megatron-core's parallel state (or `pg_collection`) to be set up,
    which `platform.init_distributed` + `parallel.initialize_parallel(layout)` do.
    """
    tconfig = transformer_config(cfg, layout, params_dtype, **config_overrides)
    block = composer_block_spec(tconfig, moe_expert_precision, moe_dispatch_precision, pg_collection,
                                grouped_experts)
    mtp = get_gpt_mtp_block_spec(tconfig, block, use_transformer_engine=False) if cfg.mtp_num_layers else None
    extra = {"pg_collection": pg_collection} if pg_collection is not None else {}
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=block,
        vocab_size=cfg.vocab_size,
        max_sequence_length=seq_length or cfg.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type="none",  # MLA applies its own RoPE
        mtp_block_spec=mtp,
        **extra,
    )
    return model
