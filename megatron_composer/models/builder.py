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
* the router: `moe.PaddingAwareTopKRouter`, megatron-core's top-k router
  whose expert-bias counts leave out pad tokens (`padding_mask`);
* an MTP block built from the last decoder layer's spec, as DeepSeek-V3;
* routed experts in the model's dtype (`moe_expert_precision` "bf16", the
  default): `moe.GroupedSequentialMLP`, megatron's SequentialMLP with one
  grouped GEMM per linear over all local experts (`grouped_experts=False`
  keeps megatron's per-expert loop);
* with `moe_expert_precision` nvfp4/mxfp8, `moe.QuantizedSequentialMLP`
  experts (megatron's SequentialMLP, expert GEMMs through `quantized_linear`);
  with `moe_dispatch_precision` mxfp8, `moe.MXFP8DispatchMoELayer` (alltoall
  dispatch payload in MXFP8, combine in BF16).

`transformer_impl` "transformer_engine" starts from megatron-core's TE spec
instead (`models.te_spec`: TE linears and norms, TEDotProductAttention at
CP = 1, TEGroupedMLP for unquantized experts) and hands it the same CP
attention and quantized experts; a TE FP8/FP4 recipe goes through
megatron-core's per-module quantization config (routed experts only by default).

Tensor parallelism runs with sequence parallelism in both implementations
(`models.tensor_parallel` says why). At TP > 1 the local spec's torch norms
and MLA attention become `SequenceParallelRMSNorm` and
`TensorParallelMLASelfAttention` from there (TE's spec needs neither); at
TP = 1 the spec is unchanged. With MoE and EP = 1, TP > 1 needs ETP = TP
(experts replicated over TP ranks that saw different tokens would be reduced
over DP only).

Fusions (`cuda_fusions`), all off on CPU, where the plain paths are exact:

    fusion                        on CUDA            needs
    bias_activation_fusion        yes                nothing: megatron's jit-fused (weighted) SwiGLU
    bias_dropout_fusion           yes                nothing: jit-fused bias-dropout-add
    apply_rope_fusion             yarn, CP = 1 (**)  Triton: megatron's fused MLA YaRN RoPE (plain RoPE has
                                                     none for MLA; megatron-core refuses the flag)
    moe_permute_fusion            with TE            TE's fused permute (bf16 dispatch only)
    masked_softmax_fusion         no                 Apex; read only by megatron's DotProductAttention
    persist_layer_norm            no                 Apex's FusedLayerNorm; torch and TE norms ignore it
    gradient_accumulation_fusion  no                 Apex for the local linears (the output layer is
                                                     local in both specs) and megatron DDP's main_grad

(**) under CP our attention applies RoPE itself, through megatron-core's
unfused path. moe_router_fusion (TE's fused top-k) stays off: the recipe's
group-limited routing with expert bias is checked against the unfused router.
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
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import MLATransformerConfig

from ..attention.core import MLACoreAttention
from ..attention.cp import ContextParallelMLASelfAttention, ZigzagCoreAttention
from ..config.model import ModelConfig
from ..config.training import RecomputeConfig, TransformerImplConfig
from ..moe import grouped_experts_spec, padding_aware_router_spec, quantized_dispatch_spec, quantized_experts_spec
from ..parallel.layout import ParallelLayout
from .tensor_parallel import SequenceParallelRMSNorm, TensorParallelMLASelfAttention
from .mtp import composer_mtp_spec
from .te_spec import check_te_choices, require_transformer_engine, te_layer_spec, te_quant_recipe


def cuda_fusions(transformer_impl: str, context_parallel: int, rope_type: str,
                 dispatch_precision: str = "bf16", on_cuda: Optional[bool] = None) -> dict:
    """megatron-core's fusion switches for this build (the table in the module docstring)."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    te = transformer_impl == "transformer_engine"
    # MLA's only fused RoPE is megatron's Triton YaRN kernel, whatever the layer implementation.
    rope_fusion = context_parallel == 1 and rope_type == "yarn" and _have_triton()
    return dict(
        bias_activation_fusion=on_cuda,
        bias_dropout_fusion=on_cuda,
        apply_rope_fusion=on_cuda and rope_fusion,
        moe_permute_fusion=on_cuda and te and dispatch_precision == "bf16",
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def check_expert_tensor_parallel(moe: bool, tp: int, ep: int, etp: int) -> None:
    """Raise if TP > 1 would leave EP = 1 experts replicated over TP ranks: megatron-core
    reduces such experts over DP only, but each TP rank fed its replicas its own
    sequence shard, so their gradients would miss the other shards'."""
    if moe and tp > 1 and ep == 1 and etp != tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} with MoE and EP=1 needs "
                         f"--expert-tensor-parallel-size {tp} (got {etp}), or EP > 1")


def _have_triton() -> bool:
    from megatron.core.fusions.fused_mla_yarn_rope_apply import HAVE_TRITON

    return bool(HAVE_TRITON)


def _recompute_kwargs(recompute: RecomputeConfig, num_layers: int, mtp: bool) -> dict:
    recompute.check_layers(num_layers)
    if recompute.recompute_granularity is None:
        return {}
    if mtp and recompute.recompute_method == "uniform" and recompute.recompute_num_layers != 1:
        raise ValueError(f"--recompute-num-layers {recompute.recompute_num_layers} with MTP: megatron-core "
                         f"recomputes MTP layers one at a time, so --recompute-method uniform needs "
                         f"--recompute-num-layers 1 (or use block)")
    modules = recompute.recompute_modules
    return dict(recompute_granularity=recompute.recompute_granularity,
                recompute_method=recompute.recompute_method,
                recompute_num_layers=recompute.recompute_num_layers,
                recompute_modules=list(modules) if modules is not None else None)


def _precision_kwargs(impl: TransformerImplConfig, recompute: RecomputeConfig, expert_precision: str) -> dict:
    check_te_choices(impl, recompute, expert_precision)
    kwargs = {}
    if impl.fp8_recipe:
        kwargs.update(fp8=impl.fp8_format, fp8_recipe=impl.fp8_recipe)
    if impl.fp4_recipe:
        kwargs.update(fp4=impl.fp4_format, fp4_recipe=impl.fp4_recipe)
    recipe = te_quant_recipe(impl.fp8_format, impl.fp8_recipe, impl.fp4_recipe, impl.te_precision_scope,
                             impl.te_precision_config_file)
    if recipe is not None:
        kwargs["quant_recipe"] = recipe
    return kwargs


def transformer_config(
    cfg: ModelConfig,
    layout: Optional[ParallelLayout] = None,
    params_dtype: torch.dtype = torch.float32,
    mtp_loss_scaling_factor: float = 0.1,
    impl: TransformerImplConfig = TransformerImplConfig(),
    recompute: RecomputeConfig = RecomputeConfig(),
    moe_expert_precision: str = "bf16",
    moe_dispatch_precision: str = "bf16",
    grouped_experts: bool = True,
    **overrides,
) -> MLATransformerConfig:
    """Map a `ModelConfig`, a parallel layout (default: one rank), the layer
    implementation / TE recipe and activation recompute onto megatron-core's
    `MLATransformerConfig`. The expert and dispatch precisions decide the
    fusions and whether experts are TE grouped GEMMs (`moe_grouped_gemm`)."""
    cfg.validate()
    layout = layout or ParallelLayout(world_size=1)
    te = impl.transformer_impl == "transformer_engine"
    moe = cfg.num_moe_layers > 0
    if te:
        require_transformer_engine()
    check_expert_tensor_parallel(moe, layout.tp, layout.ep, layout.etp)
    yarn = cfg.yarn
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
        **cuda_fusions(impl.transformer_impl, layout.cp, "yarn" if yarn else "rope",
                       dispatch_precision=moe_dispatch_precision),
        transformer_impl=impl.transformer_impl,
        **_precision_kwargs(impl, recompute, moe_expert_precision),
        **_recompute_kwargs(recompute, cfg.num_layers, bool(cfg.mtp_num_layers)),
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
            # TE: TEGroupedMLP for unquantized experts; ours are SequentialMLPs.
            moe_grouped_gemm=te and moe_expert_precision == "bf16",
        )
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def _use_our_attention(layer_spec: ModuleSpec, context_parallel: bool, te: bool) -> None:
    attention = layer_spec.submodules.self_attention
    assert attention.module is MLASelfAttention, attention.module
    if context_parallel:
        # CP: latent all-gather + zigzag queries (attention/cp.py), not TE's ring.
        attention.module = ContextParallelMLASelfAttention
        attention.submodules.core_attention = ZigzagCoreAttention
    elif not te:  # TE's spec keeps TEDotProductAttention
        attention.submodules.core_attention = MLACoreAttention


def _use_our_moe(layer_spec: ModuleSpec, expert_precision: str, dispatch_precision: str,
                 pg_collection=None, grouped_experts: bool = True, te: bool = False) -> None:
    mlp = layer_spec.submodules.mlp
    if mlp.module is not MoELayer:  # a dense layer
        return
    experts = quantized_experts_spec(mlp.submodules.experts, expert_precision)
    if expert_precision == "bf16" and grouped_experts and not te:  # TE's spec has TEGroupedMLP
        experts = grouped_experts_spec(experts)
    mlp.submodules.experts = experts
    padding_aware_router_spec(mlp.submodules)
    layer_spec.submodules.mlp = quantized_dispatch_spec(mlp, dispatch_precision, pg_collection)


def composer_block_spec(tconfig: MLATransformerConfig, moe_expert_precision: str = "bf16",
                        moe_dispatch_precision: str = "bf16", pg_collection=None,
                        grouped_experts: bool = True):
    """Decoder block spec: megatron-core's local or TE MLA spec (`tconfig.transformer_impl`)
    with our (CP) attention and experts."""
    te = tconfig.transformer_impl == "transformer_engine"
    if te:
        require_transformer_engine()
    block = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=te, normalization="RMSNorm")
    # Layer specs are shared objects between layers of the same kind; copy
    # before editing so megatron-core's module-level specs stay untouched.
    block.layer_specs = [_copy_spec(spec) for spec in block.layer_specs]
    for spec in block.layer_specs:
        if te:
            te_layer_spec(spec, moe_expert_precision)
        _use_our_attention(spec, tconfig.context_parallel_size > 1, te)
        _use_our_moe(spec, moe_expert_precision, moe_dispatch_precision, pg_collection, grouped_experts, te)
    return block


def mtp_block_spec(tconfig: MLATransformerConfig, block):
    """megatron-core's MTP block spec (DeepSeek-V3's) around the last decoder layer's spec, with
    `models.mtp.ComposerMTPLayer` layers (sync-free packed roll, full recompute of packed batches)."""
    te = tconfig.transformer_impl == "transformer_engine"
    spec = get_gpt_mtp_block_spec(tconfig, block, use_transformer_engine=te)
    # Copied first: with one MTP layer the list holds megatron-core's shared spec object.
    spec.layer_specs = [dataclasses.replace(layer) for layer in spec.layer_specs]
    return composer_mtp_spec(spec)


_SEQUENCE_PARALLEL_LOCAL = {WrappedTorchNorm: SequenceParallelRMSNorm,
                            MLASelfAttention: TensorParallelMLASelfAttention}


def _sequence_parallel_local(spec):
    """Swap the local spec's pieces that do not fit sequence parallelism (its torch norm,
    MLA's column-parallel KV down-projection) in a (copied) spec tree for
    `models.tensor_parallel`'s, in place."""
    if isinstance(spec, (list, tuple)):
        return type(spec)(_sequence_parallel_local(s) for s in spec)
    if isinstance(spec, type):
        return _SEQUENCE_PARALLEL_LOCAL.get(spec, spec)
    if isinstance(spec, ModuleSpec):
        spec.module = _sequence_parallel_local(spec.module)
        spec.submodules = _sequence_parallel_local(spec.submodules)
        return spec
    if dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _sequence_parallel_local(getattr(spec, f.name)))
    return spec


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
    impl: TransformerImplConfig = TransformerImplConfig(),
    recompute: RecomputeConfig = RecomputeConfig(),
    **config_overrides,
) -> GPTModel:
    """Build the Composer GPTModel on the current device.

    moe_expert_precision: "bf16" (unquantized: the experts run in the model's
    dtype, fp32 when `params_dtype` is fp32), "mxfp8" or "nvfp4" (NVFP4
    forward, MXFP8 backward); moe_dispatch_precision: "bf16" or "mxfp8" (EP
    dispatch payload). See `megatron_composer.moe`. grouped_experts: the
    unquantized experts as `GroupedSequentialMLP` (one grouped GEMM per
    linear); False gives megatron's SequentialMLP (same parameters).
    impl: local or Transformer Engine layers and the TE FP8/FP4 recipe;
    recompute: activation recompute (both megatron-core's, see the configs).

    Needs megatron-core's parallel state (or `pg_collection`) to be set up,
    which `platform.init_distributed` + `parallel.initialize_parallel(layout)` do.
    """
    tconfig = transformer_config(cfg, layout, params_dtype, impl=impl, recompute=recompute,
                                 moe_expert_precision=moe_expert_precision,
                                 moe_dispatch_precision=moe_dispatch_precision,
                                 grouped_experts=grouped_experts, **config_overrides)
    block = composer_block_spec(tconfig, moe_expert_precision, moe_dispatch_precision, pg_collection,
                                grouped_experts)
    mtp = mtp_block_spec(tconfig, block) if cfg.mtp_num_layers else None
    if tconfig.sequence_parallel and tconfig.transformer_impl == "local":
        block, mtp = _sequence_parallel_local(block), _sequence_parallel_local(mtp)
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
