"""The Transformer Engine layer spec and its per-module quantization recipe.

`te_layer_spec(spec, ...)` edits one layer of megatron-core's TE spec
(`get_gpt_decoder_block_spec(use_transformer_engine=True)`) in place:

* norms stay separate `TENorm`s ahead of plain TE linears
  (`TEColumnParallelLinear`) instead of megatron-core's fused
  `TELayerNormColumnParallelLinear`, so parameter names are those of the
  local spec (`q_layernorm.weight`, `pre_mlp_layernorm.weight`,
  `mlp.linear_fc1.weight`): HF conversion, Muon's parameter groups and
  checkpoints read both implementations alike. The cost is one norm output
  per fused pair kept for backward;
* core attention: TE's `TEDotProductAttention` (MLA's k_channels !=
  v_channels) at CP = 1; our `ContextParallelMLASelfAttention` +
  `ZigzagCoreAttention` under CP (latent all-gather, not TE's ring);
* routed experts: megatron-core's `TEGroupedMLP` (`moe_grouped_gemm`, one TE
  grouped GEMM per linear) for unquantized experts. Its parameters are
  `experts.linear_fc{1,2}.weight{i}`, not the local spec's
  `experts.local_experts.{i}.linear_fc{1,2}.weight`, but hold the same
  tensors; checkpoints store both under one global-expert name
  (`checkpoint.state.expert_param_parts`), so a TE checkpoint loads into a
  local-impl model and converts to HF like any other. With
  `--moe-expert-precision nvfp4/mxfp8` our `QuantizedSequentialMLP` (local
  linears through `quant.quantized_linear`) is plugged in instead.

`te_quant_recipe` builds megatron-core's per-module quantization config
(`TransformerConfig.quant_recipe`, `quantization.RecipeConfig`): the global
TE recipe (`fp8`/`fp4` + `fp8_recipe`/`fp4_recipe`) opens the autocast over
every layer, and glob matchers keep every TE linear but the routed experts'
in high precision. Megatron-LM's `--te-precision-config-file` YAML replaces
it; scope "all" drops it (every TE linear quantized, megatron-core's default).
"""
from __future__ import annotations

import importlib.util
from typing import Optional

from megatron.core.enums import Fp4Recipe, Fp8Recipe
from megatron.core.quantization.quant_config import GlobMatcher, RecipeConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

INSTALL_HINT = "pip install -e '.[gpu]'"
# Module paths of the routed experts' linears (TEGroupedMLP: `...mlp.experts.linear_fc1`),
# in the decoder and in the MTP block; not the shared experts (`...mlp.shared_experts...`).
ROUTED_EXPERTS_PATTERN = "*.mlp.experts.*"


def transformer_engine_import_error() -> Optional[str]:
    """None when `transformer_engine.pytorch` imports (a CPU-only torch has no TE build), else why not:
    "not installed", or the exception (a TE whose CUDA libraries do not load raises OSError)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def have_transformer_engine() -> bool:
    """Whether `transformer_engine.pytorch` imports."""
    return transformer_engine_import_error() is None


def require_transformer_engine() -> None:
    """Raise a ValueError naming the install if Transformer Engine does not import."""
    error = transformer_engine_import_error()
    if error is not None:
        raise ValueError(
            f"--transformer-impl transformer_engine needs Transformer Engine, which does not import here "
            f"({error}); install it with `{INSTALL_HINT}` (transformer-engine[pytorch] for CUDA; "
            "`python -m megatron_composer.platform.doctor` checks it), or use --transformer-impl local")


def check_te_choices(impl, recompute, expert_precision: str) -> None:
    """Raise a ValueError naming the flags when the TE recipe, recompute modules and
    `--moe-expert-precision` contradict each other (`config.training`'s
    TransformerImplConfig / RecomputeConfig; each checks its own values)."""
    if impl.te_recipe and expert_precision != "bf16":
        kind, recipe = impl.te_recipe.split("-", 1)
        raise ValueError(
            f"--{kind}-recipe {recipe} and --moe-expert-precision {expert_precision} both quantize the routed "
            f"experts; use one (--moe-expert-precision bf16 with the TE recipe, or no TE recipe with our exact "
            f"{expert_precision} emulation)")
    te = impl.transformer_impl == "transformer_engine"
    modules = recompute.recompute_modules or ()
    if "layernorm" in modules and not te:
        # megatron-core 0.16.1 builds the norm checkpoint as CheckpointWithoutOutput(fp8=False),
        # which it reads as "fp8 on" and then asks Transformer Engine for the FP8 state.
        raise ValueError("--recompute-modules layernorm needs --transformer-impl transformer_engine "
                         "(megatron-core's norm recompute goes through TE); drop it with local")
    if "moe_act" in modules and not (te and expert_precision == "bf16"):
        raise ValueError(
            "--recompute-modules moe_act needs TE's grouped experts (megatron-core's moe_grouped_gemm): "
            "--transformer-impl transformer_engine with --moe-expert-precision bf16; or recompute moe / mlp")


def te_layer_spec(spec: ModuleSpec, expert_precision: str) -> None:
    """Edit one layer of megatron-core's TE MLA spec as the module docstring says
    (attention under CP is swapped afterwards, the same way as for the local spec)."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.linear_q_up_proj, attention.q_layernorm = TEColumnParallelLinear, TENorm
    attention.linear_kv_up_proj, attention.kv_layernorm = TEColumnParallelLinear, TENorm
    mlp = layer.mlp
    if issubclass(mlp.module, MoELayer):
        if expert_precision != "bf16":
            # Our quantized experts multiply local-spec linears through quant.quantized_linear.
            mlp.submodules.experts = ModuleSpec(
                module=SequentialMLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
        return
    if layer.pre_mlp_layernorm is IdentityOp:  # dense MLP: the norm was fused into linear_fc1
        layer.pre_mlp_layernorm = TENorm
        mlp.submodules.linear_fc1 = TEColumnParallelLinear


def te_quant_recipe(fp8_format: Optional[str], fp8_recipe: Optional[str], fp4_recipe: Optional[str],
                    scope: str = "experts", config_file: Optional[str] = None) -> Optional[RecipeConfig]:
    """megatron-core's `quant_recipe` for the TE recipe: None quantizes every TE
    linear under the global recipe; "experts" keeps all but the routed experts in
    high precision. `config_file`: Megatron-LM's --te-precision-config-file YAML."""
    if config_file is not None:
        from megatron.core.quantization.utils import load_quantization_recipe

        return load_quantization_recipe(config_file)
    if scope == "all" or (fp8_recipe is None and fp4_recipe is None):
        return None
    if fp8_recipe is not None:
        quantized = {"fp8_quantization_recipe": Fp8Recipe(fp8_recipe), "fp8_format": fp8_format}
    else:
        quantized = {"fp4_quantization_recipe": Fp4Recipe(fp4_recipe)}
    params = {"transformer_engine_config_type": "TEQuantizationParams"}
    return RecipeConfig(
        matchers=[GlobMatcher(ROUTED_EXPERTS_PATTERN, "routed_experts"), GlobMatcher("*", "high_precision")],
        config_dict={"routed_experts": dict(params, training_recipe=quantized),
                     "high_precision": dict(params, training_recipe={})},
    )
