"""--transformer-impl, TE FP8/FP4 recipes, CUDA fusions.

CPU: flag parsing and validation, the per-generation recipe table, the local
spec unchanged, the quantization recipe's matchers, and the clear error when
Transformer Engine is asked for but absent. GPU + TE (`make test-gpu` where TE
is installed): the TE spec builds from TE modules and the model steps in the
trainer in bf16, with FP8 on Hopper and MXFP8 / NVFP4 on Blackwell.
"""
import dataclasses

import pytest
import torch

from megatron_composer.config import get_preset
from megatron_composer.config.training import RecomputeConfig, TransformerImplConfig
from megatron_composer.models.te_spec import have_transformer_engine
from megatron_composer.platform.recipes import RECIPES, available_recipes, check_recipe

TINY = get_preset("tiny")
# TE's block-scaled recipes tile the quantized (expert) GEMMs in blocks of up to 128.
QUANT_TINY = dataclasses.replace(TINY, moe_ffn_hidden_size=128)


# ---------------------------------------------------------------- recipes table
@pytest.mark.parametrize("capability, expected", [
    ((7, 0), []),
    ((8, 0), []),
    ((8, 6), []),
    ((8, 9), ["fp8-tensorwise"]),
    ((9, 0), ["fp8-tensorwise", "fp8-blockwise"]),
    ((10, 0), ["fp8-tensorwise", "fp8-blockwise", "fp8-mxfp8", "fp4-nvfp4"]),
    ((10, 3), ["fp8-tensorwise", "fp8-blockwise", "fp8-mxfp8", "fp4-nvfp4"]),
    ((12, 0), ["fp8-tensorwise", "fp8-blockwise"]),  # TE: MXFP8 no, NVFP4 partial on 12.0
])
def test_available_recipes_per_generation(capability, expected):
    assert available_recipes(capability, "12.9") == expected
    assert available_recipes(capability, "13.0", te="2.11.0") == expected


@pytest.mark.parametrize("capability, cuda, te, expected", [
    # TE's block-scaled FP8 GEMM needs torch built for CUDA >= 12.9 (check_fp8_block_scaling_support)
    ((9, 0), "12.8", None, ["fp8-tensorwise"]),
    ((9, 0), "12.6", "2.11.0", ["fp8-tensorwise"]),
    ((10, 0), "12.8", None, ["fp8-tensorwise", "fp8-mxfp8", "fp4-nvfp4"]),
    ((9, 0), None, None, ["fp8-tensorwise"]),
    # TE before 2.9 runs block scaling on Hopper only
    ((10, 0), "12.9", "2.8.0", ["fp8-tensorwise", "fp8-mxfp8", "fp4-nvfp4"]),
    ((9, 0), "12.9", "2.8.0", ["fp8-tensorwise", "fp8-blockwise"]),
    # FP8 on Ada needs CUDA >= 12.1 (check_fp8_support)
    ((8, 9), "12.0", None, []),
    ((8, 9), "12.1", None, ["fp8-tensorwise"]),
])
def test_available_recipes_follow_the_cuda_and_te_versions(capability, cuda, te, expected):
    assert available_recipes(capability, cuda, te) == expected


def test_check_recipe_names_the_generation_and_what_works():
    check_recipe("fp8-blockwise", (9, 0), "12.9")
    with pytest.raises(ValueError, match=r"--fp8-recipe mxfp8 needs data-center Blackwell.*H200 is Hopper "
                                         r"\(compute capability 9.0\).*fp8-tensorwise, fp8-blockwise"):
        check_recipe("fp8-mxfp8", (9, 0), "12.9", "H200")
    with pytest.raises(ValueError, match=r"--fp4-recipe nvfp4 .* Ada .*: fp8-tensorwise"):
        check_recipe("fp4-nvfp4", (8, 9), "12.9")
    with pytest.raises(ValueError, match=r"Ampere .*none \(bf16 only\)"):
        check_recipe("fp8-tensorwise", (8, 0), "12.9")
    with pytest.raises(ValueError, match=r"unknown TE recipe 'fp8-delayed'"):
        check_recipe("fp8-delayed", (9, 0), "12.9")


def test_check_recipe_names_the_cuda_version_and_what_works():
    with pytest.raises(ValueError, match=r"--fp8-recipe blockwise needs CUDA 12.9 or newer .*built with CUDA 12.8\. "
                                         r"H100 is Hopper \(compute capability 9.0\), where these TE recipes run: "
                                         r"fp8-tensorwise\. .*cu129"):
        check_recipe("fp8-blockwise", (9, 0), "12.8", "H100")
    with pytest.raises(ValueError, match=r"needs Transformer Engine 2.9 or newer beyond Hopper; "
                                         r"transformer-engine 2.8.1 is installed"):
        check_recipe("fp8-blockwise", (10, 0), "12.9", "B200", te="2.8.1")


def test_start_up_refuses_blockwise_on_hopper_with_cuda_12_8(monkeypatch):
    """The flag check run at start-up reads torch's CUDA version, not only the GPU."""
    from megatron_composer.config import TrainingConfig
    from megatron_composer.models import te_spec
    from megatron_composer.training.arguments import check_transformer_impl

    args = _parse("--transformer-impl", "local", "--bf16")
    cfg = dataclasses.replace(TrainingConfig.from_args(args), transformer=TransformerImplConfig(
        "transformer_engine", fp8_format="e4m3", fp8_recipe="blockwise"))
    monkeypatch.setattr(te_spec, "require_transformer_engine", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError, match=r"--fp8-recipe blockwise needs CUDA 12.9 or newer.*NVIDIA H100"):
        check_transformer_impl(cfg, TINY)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    check_transformer_impl(cfg, TINY)


# ---------------------------------------------------------------- flags
def _parse(*flags):
    from megatron_composer.training.arguments import parse_args

    return parse_args(["--train-iters", "1", *flags])


def test_default_impl_follows_whether_te_imports():
    args = _parse()
    assert args.transformer_impl == ("transformer_engine" if have_transformer_engine() else "local")
    assert args.recompute_granularity is None and args.fp8_format is None


def test_te_flags_map_onto_the_config():
    from megatron_composer.config import TrainingConfig

    args = _parse("--transformer-impl", "local", "--recompute-granularity", "selective",
                  "--recompute-modules", "core_attn", "mla_up_proj")
    cfg = TrainingConfig.from_args(args)
    assert cfg.transformer == TransformerImplConfig("local")
    assert cfg.recompute == RecomputeConfig("selective", recompute_modules=("core_attn", "mla_up_proj"))


@pytest.mark.parametrize("flags, match", [
    (["--transformer-impl", "local", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
     r"--fp8-recipe blockwise runs through Transformer Engine; add --transformer-impl transformer_engine"),
    (["--transformer-impl", "local", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
     r"--fp4-recipe nvfp4 runs through Transformer Engine"),
    (["--transformer-impl", "local", "--te-precision-config-file", "q.yaml"], r"--te-precision-config-file runs"),
    (["--transformer-impl", "local", "--fp8-format", "e4m3"], r"--fp8-format and --fp8-recipe go together"),
    (["--transformer-impl", "local", "--fp8-recipe", "tensorwise"], r"--fp8-format and --fp8-recipe go together"),
    (["--transformer-impl", "local", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp4-format", "e2m1",
      "--fp4-recipe", "nvfp4"], r"--fp8-format e4m3 and --fp4-format e2m1 are exclusive"),
    (["--transformer-impl", "local", "--recompute-granularity", "full"], r"full needs --recompute-method"),
    (["--transformer-impl", "local", "--recompute-modules", "core_attn"], r"needs --recompute-granularity selective"),
    (["--transformer-impl", "local", "--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "5"], r"--recompute-num-layers 5 is more than the model's 4 layers"),
    (["--transformer-impl", "local", "--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
     r"layernorm needs --transformer-impl transformer_engine"),
    (["--optimizer", "muon", "--tensor-model-parallel-size", "2"], r"--optimizer muon .* use --optimizer adam"),
    (["--tensor-model-parallel-size", "2"], r"with MoE and EP=1 needs --expert-tensor-parallel-size 2 \(got 1\)"),
])
def test_bad_combinations_name_their_flags(flags, match):
    with pytest.raises(ValueError, match=match):
        _parse(*flags)


def test_te_recipe_and_our_expert_quantization_are_exclusive():
    from megatron_composer.models.te_spec import check_te_choices

    impl = TransformerImplConfig("transformer_engine", fp4_format="e2m1", fp4_recipe="nvfp4")
    with pytest.raises(ValueError, match=r"--fp4-recipe nvfp4 and --moe-expert-precision nvfp4 both quantize"):
        check_te_choices(impl, RecomputeConfig(), "nvfp4")
    check_te_choices(impl, RecomputeConfig(), "bf16")
    check_te_choices(TransformerImplConfig("transformer_engine"), RecomputeConfig(), "nvfp4")  # the reference


@pytest.mark.skipif(have_transformer_engine(), reason="checks the error without Transformer Engine")
def test_asking_for_te_without_it_names_the_install():
    from megatron_composer.models import build_model

    with pytest.raises(ValueError, match=r"needs Transformer Engine.*pip install -e '\.\[gpu\]'"):
        _parse("--transformer-impl", "transformer_engine")
    with pytest.raises(ValueError, match=r"pip install -e '\.\[gpu\]'.*--transformer-impl local"):
        build_model(TINY, impl=TransformerImplConfig("transformer_engine"))


@pytest.mark.skipif(have_transformer_engine(), reason="checks the error without Transformer Engine")
def test_a_transformer_engine_that_fails_to_load_is_named(tmp_path, monkeypatch):
    """A TE whose CUDA libraries do not load raises OSError; the error says so, not only "install it"."""
    import sys

    from megatron_composer.models.te_spec import require_transformer_engine

    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text(
        'raise OSError("libtransformer_engine.so: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"does not import here \(OSError: libtransformer_engine\.so: cannot "
                                         r"open shared object file\); .*platform\.doctor"):
        require_transformer_engine()
    assert "transformer_engine" not in sys.modules


# ---------------------------------------------------------------- quantization recipe
def test_quant_recipe_quantizes_only_the_routed_experts():
    from megatron.core.quantization.utils import get_quant_config_or_none

    from megatron_composer.models.te_spec import te_quant_recipe

    recipe = te_quant_recipe("e4m3", "blockwise", None)
    expected = {
        "decoder.layers.1.mlp.experts.linear_fc1": {"fp8_quantization_recipe": "blockwise", "fp8_format": "e4m3"},
        "decoder.layers.3.mlp.experts.linear_fc2": {"fp8_quantization_recipe": "blockwise", "fp8_format": "e4m3"},
        "mtp.layers.0.transformer_layer.mlp.experts.linear_fc1": {"fp8_quantization_recipe": "blockwise",
                                                                  "fp8_format": "e4m3"},
        "decoder.layers.1.mlp.shared_experts.linear_fc1": {},
        "decoder.layers.0.mlp.linear_fc1": {},
        "decoder.layers.2.self_attention.linear_kv_up_proj": {},
        "mtp.layers.0.eh_proj": {},
    }
    for path, training_recipe in expected.items():
        config = get_quant_config_or_none(path, recipe).config
        assert config["transformer_engine_config_type"] == "TEQuantizationParams"
        assert config["training_recipe"] == training_recipe, path
    nvfp4 = te_quant_recipe(None, None, "nvfp4")
    assert get_quant_config_or_none("decoder.layers.1.mlp.experts.linear_fc2", nvfp4).config[
        "training_recipe"] == {"fp4_quantization_recipe": "nvfp4"}
    assert te_quant_recipe("e4m3", "blockwise", None, scope="all") is None
    assert te_quant_recipe(None, None, None) is None


def test_te_precision_config_file_is_megatrons_yaml(tmp_path):
    from megatron.core.quantization.utils import get_quant_config_or_none

    from megatron_composer.models.te_spec import te_quant_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text("configs:\n  bf16:\n    transformer_engine_config_type: TEQuantizationParams\n"
                    "    training_recipe: {}\nmatchers:\n  kv_up:\n    type: glob\n    enabled: true\n"
                    "    pattern: '*.linear_kv_up_proj'\n    config: bf16\n")
    recipe = te_quant_recipe("e4m3", "tensorwise", None, config_file=str(path))
    assert get_quant_config_or_none("decoder.layers.0.self_attention.linear_kv_up_proj", recipe).config_key == "bf16"
    assert get_quant_config_or_none("decoder.layers.1.mlp.experts.linear_fc1", recipe) is None


# ---------------------------------------------------------------- local spec, fusions
def _init_parallel():
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    layout = ParallelLayout(world_size=init_distributed().world_size)
    initialize_parallel(layout, seed=1234)
    return layout


def test_local_spec_is_unchanged_at_tp1():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_composer.attention.core import MLACoreAttention
    from megatron_composer.models.builder import composer_block_spec, transformer_config
    from megatron_composer.moe import GroupedSequentialMLP

    _init_parallel()
    tconfig = transformer_config(TINY)
    assert tconfig.transformer_impl == "local" and not tconfig.sequence_parallel
    assert not tconfig.moe_grouped_gemm and tconfig.fp8 is None and tconfig.quant_recipe is None
    assert tconfig.recompute_granularity is None
    block = composer_block_spec(tconfig)
    assert block.layer_norm is WrappedTorchNorm
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention
        assert attention.module is MLASelfAttention
        assert attention.submodules.core_attention is MLACoreAttention
        assert spec.submodules.input_layernorm is WrappedTorchNorm
        if issubclass(spec.submodules.mlp.module, MoELayer):
            assert spec.submodules.mlp.submodules.experts.module is GroupedSequentialMLP


def test_te_layer_spec_unfuses_norms_and_plugs_in_our_experts():
    """On a TE-shaped spec (megatron-core's fused layer-norm linears, grouped experts):
    separate TENorms ahead of TE linears, local-linear SequentialMLP for our quantized experts."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_composer.models.builder import composer_block_spec, transformer_config
    from megatron_composer.models.te_spec import te_layer_spec

    class FusedNormLinear:  # stands in for TELayerNormColumnParallelLinear
        pass

    _init_parallel()
    for precision in ("bf16", "nvfp4"):
        block = composer_block_spec(transformer_config(TINY), grouped_experts=False)
        dense, moe = block.layer_specs[0].submodules, block.layer_specs[1].submodules
        for layer in (dense, moe):
            attention = layer.self_attention.submodules
            attention.linear_q_up_proj = attention.linear_kv_up_proj = FusedNormLinear
            attention.q_layernorm = attention.kv_layernorm = IdentityOp
        dense.pre_mlp_layernorm, dense.mlp.submodules.linear_fc1 = IdentityOp, FusedNormLinear
        grouped = ModuleSpec(module=FusedNormLinear)  # stands in for TEGroupedMLP
        moe.mlp.submodules.experts = grouped
        te_layer_spec(block.layer_specs[0], precision)
        te_layer_spec(block.layer_specs[1], precision)
        for layer in (dense, moe):
            attention = layer.self_attention.submodules
            assert attention.linear_q_up_proj is TEColumnParallelLinear and attention.q_layernorm is TENorm
            assert attention.linear_kv_up_proj is TEColumnParallelLinear and attention.kv_layernorm is TENorm
        assert dense.pre_mlp_layernorm is TENorm and dense.mlp.submodules.linear_fc1 is TEColumnParallelLinear
        assert issubclass(moe.mlp.module, MoELayer)
        experts = moe.mlp.submodules.experts
        if precision == "bf16":
            assert experts is grouped
        else:
            assert experts.module is SequentialMLP
            assert experts.submodules.linear_fc1 is ColumnParallelLinear
            assert experts.submodules.linear_fc2 is RowParallelLinear


def test_cuda_fusions_table():
    from megatron_composer.models.builder import cuda_fusions

    assert not any(cuda_fusions("local", 1, "yarn", on_cuda=False).values())
    assert not any(cuda_fusions("transformer_engine", 1, "rope", on_cuda=False).values())
    local = cuda_fusions("local", 1, "rope", on_cuda=True)
    assert local["bias_activation_fusion"] and local["bias_dropout_fusion"]
    assert not local["apply_rope_fusion"] and not local["moe_permute_fusion"]  # both TE kernels here
    te = cuda_fusions("transformer_engine", 1, "rope", on_cuda=True)
    # megatron-core fuses MLA's RoPE only for YaRN (its Triton kernel), with or without TE
    assert not te["apply_rope_fusion"] and te["moe_permute_fusion"]
    assert cuda_fusions("transformer_engine", 1, "yarn", on_cuda=True)["apply_rope_fusion"]
    assert not cuda_fusions("transformer_engine", 2, "yarn", on_cuda=True)["apply_rope_fusion"]
    assert not cuda_fusions("transformer_engine", 1, "rope", "mxfp8", on_cuda=True)["moe_permute_fusion"]
    for off in ("masked_softmax_fusion", "persist_layer_norm", "gradient_accumulation_fusion"):
        assert not te[off] and not local[off]


@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_cuda_config_is_one_megatron_core_accepts(preset, impl, yarn, monkeypatch):
    """The MLATransformerConfig a CUDA run of the preset hands megatron-core constructs
    (its __post_init__ checks the fusions against the RoPE type); built here with CUDA
    faked and Transformer Engine taken as present."""
    import importlib.util

    from megatron_composer.config.model import YarnConfig
    from megatron_composer.models import builder

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builder, "require_transformer_engine", lambda: None)
    from megatron.core.transformer.moe import moe_utils

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):  # TE's, checked by name
        monkeypatch.setattr(moe_utils, name, object(), raising=False)
    cfg = get_preset(preset)
    if yarn:
        cfg = dataclasses.replace(cfg, yarn=YarnConfig(factor=4.0, original_max_position_embeddings=1024))
    tconfig = builder.transformer_config(cfg, params_dtype=torch.bfloat16, impl=TransformerImplConfig(impl))
    # MLA's fused RoPE is megatron-core's Triton YaRN kernel; plain RoPE has none.
    assert tconfig.apply_rope_fusion == (yarn and importlib.util.find_spec("triton") is not None)
    assert tconfig.bias_dropout_fusion and tconfig.moe_permute_fusion == (impl == "transformer_engine")


def test_tp_with_replicated_experts_needs_etp():
    from megatron_composer.models.builder import transformer_config
    from megatron_composer.parallel import ParallelLayout

    layout = ParallelLayout(world_size=2, tp=2, num_experts=TINY.num_experts)
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 2 with MoE and EP=1 needs "
                                         r"--expert-tensor-parallel-size 2 \(got 1\)"):
        transformer_config(TINY, layout)


# ---------------------------------------------------------------- GPU + TE
def _capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _te_trainer(fp8_recipe=None, fp4_recipe=None, expert_precision="bf16", steps=2):
    from megatron_composer.config import MoEPrecisionConfig
    from megatron_composer.data.random_tokens import RandomTokenDataset
    from tests.trainers import make_trainer

    impl = TransformerImplConfig("transformer_engine", fp8_format="e4m3" if fp8_recipe else None,
                                 fp8_recipe=fp8_recipe, fp4_format="e2m1" if fp4_recipe else None,
                                 fp4_recipe=fp4_recipe)
    # Quantized grouped GEMMs want 16/32-aligned tokens per expert; megatron-core pads them.
    tr = make_trainer(RandomTokenDataset(16, 128, TINY.vocab_size), model_cfg=QUANT_TINY, bf16=True,
                      seq_length=128, transformer=impl,
                      moe_precision=MoEPrecisionConfig(moe_expert_precision=expert_precision))
    results = [tr.step() for _ in range(steps)]
    return tr, results


@pytest.mark.gpu
@pytest.mark.te
def test_te_spec_builds_from_te_modules():
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TEDotProductAttention,
        TENorm,
        TERowParallelLinear,
    )
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_composer.models import build_model
    from megatron_composer.models.builder import composer_block_spec, mtp_block_spec, transformer_config

    _init_parallel()
    impl = TransformerImplConfig("transformer_engine")
    tconfig = transformer_config(TINY, impl=impl, params_dtype=torch.bfloat16)
    assert tconfig.moe_grouped_gemm and tconfig.bias_activation_fusion and tconfig.moe_permute_fusion
    block = composer_block_spec(tconfig)
    assert block.layer_norm is TENorm
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention.submodules
        assert attention.core_attention is TEDotProductAttention
        assert attention.linear_kv_up_proj is TEColumnParallelLinear and attention.kv_layernorm is TENorm
        assert attention.linear_proj is TERowParallelLinear and spec.submodules.pre_mlp_layernorm is TENorm
    assert block.layer_specs[1].submodules.mlp.submodules.experts.module is TEGroupedMLP
    mtp = mtp_block_spec(tconfig, block)
    assert mtp.layer_specs[0].submodules.enorm is TENorm

    model = build_model(TINY, impl=impl, params_dtype=torch.bfloat16)
    names = {n for n, _ in model.named_parameters()}
    # The local spec's names, except the grouped experts' weight{i} (stored alike: checkpoint.state).
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names or TINY.q_lora_rank is None
    assert "decoder.layers.1.self_attention.kv_layernorm.weight" in names
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in names
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight0" in names


@pytest.mark.gpu
@pytest.mark.te
def test_te_model_steps_in_bf16():
    tr, results = _te_trainer()
    assert all(torch.isfinite(torch.tensor(r.lm_loss)) and not r.skipped for r in results)
    assert results[1].lm_loss < results[0].lm_loss + 0.5


@pytest.mark.gpu
@pytest.mark.te
def test_te_and_local_give_close_losses():
    """Same weights (the parameter names match but for the grouped experts), same batch: bf16 TE vs local."""
    from megatron_composer.data.random_tokens import RandomTokenDataset
    from tests.trainers import make_trainer

    data = RandomTokenDataset(16, 128, TINY.vocab_size)
    dense = dataclasses.replace(TINY, num_experts=0, first_k_dense_layers=TINY.num_layers)
    local = make_trainer(data, model_cfg=dense, bf16=True, seq_length=128)
    te = make_trainer(data, model_cfg=dense, bf16=True, seq_length=128,
                      transformer=TransformerImplConfig("transformer_engine"))
    state = {k: v for k, v in local.model.gpt.state_dict().items() if "_extra_state" not in k}
    missing, unexpected = te.model.gpt.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    a, b = local.step().lm_loss, te.step().lm_loss
    assert abs(a - b) < 0.02 * abs(a), (a, b)


@pytest.mark.gpu
@pytest.mark.te
def test_te_checkpoint_loads_into_a_local_model(tmp_path):
    """A TE model's checkpoint (TEGroupedMLP experts, `linear_fc1.weight{i}`) loads into
    a local-impl model (`local_experts.{i}.linear_fc1.weight`): the same fp32 logits."""
    from megatron_composer import checkpoint as ck
    from megatron_composer.models import build_model, composer_forward

    layout = _init_parallel()
    te = build_model(TINY, layout, seq_length=64, impl=TransformerImplConfig("transformer_engine")).cuda()
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight0" in dict(te.named_parameters())
    ck.save_checkpoint(str(tmp_path), 1, te, None, {})
    local = build_model(TINY, layout, seq_length=64).cuda()
    with torch.no_grad():
        for p in local.parameters():
            p.add_(torch.randn_like(p))  # so that only the load can make the two agree
    ck.load_checkpoint(str(tmp_path), local)
    tokens = torch.randint(0, TINY.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(64, device="cuda").expand(2, 64)
    with torch.no_grad():
        te_logits, local_logits = (composer_forward(m.eval(), tokens, positions)[0] for m in (te, local))
    torch.testing.assert_close(local_logits.float(), te_logits.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.parametrize("fp8_recipe, fp4_recipe", [
    ("tensorwise", None), ("blockwise", None), ("mxfp8", None), (None, "nvfp4")])
def test_te_recipes_step_where_the_gpu_has_them(fp8_recipe, fp4_recipe):
    name = f"fp8-{fp8_recipe}" if fp8_recipe else f"fp4-{fp4_recipe}"
    assert name in RECIPES
    if name not in available_recipes(_capability(), torch.version.cuda):
        with pytest.raises(ValueError) as err:
            check_recipe(name, _capability(), torch.version.cuda, torch.cuda.get_device_name())
        pytest.skip(str(err.value))
    tr, results = _te_trainer(fp8_recipe, fp4_recipe)
    assert all(torch.isfinite(torch.tensor(r.lm_loss)) and not r.skipped for r in results)
    experts = tr.model.gpt.decoder.layers[1].mlp.experts
    assert experts.linear_fc1.te_quant_params is not None  # the routed experts carry the recipe
    attention = tr.model.gpt.decoder.layers[1].self_attention
    assert attention.linear_proj.te_quant_params.training_recipe.fp8_quantization_recipe is None


@pytest.mark.gpu
@pytest.mark.te
def test_te_with_our_nvfp4_experts_steps():
    """Our exact NVFP4 emulation stays pluggable as the reference under TE layers."""
    from megatron_composer.moe import QuantizedSequentialMLP

    tr, results = _te_trainer(expert_precision="nvfp4")
    assert isinstance(tr.model.gpt.decoder.layers[1].mlp.experts, QuantizedSequentialMLP)
    assert all(not r.skipped for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_cuda_fusions_keep_the_local_model_close(yarn):
    """Local spec on CUDA with megatron-core's non-TE fusions (yarn: the Triton MLA RoPE)
    vs all fusions off, fp32."""
    from megatron_composer.config.model import YarnConfig
    from megatron_composer.models import build_model, composer_forward
    from megatron_composer.models.builder import cuda_fusions

    cfg = dataclasses.replace(TINY, yarn=YarnConfig(factor=4.0, original_max_position_embeddings=1024,
                                                    mscale=1.0, mscale_all_dim=1.0)) if yarn else TINY
    outs = []
    for on in (False, True):
        layout = _init_parallel()
        fusions = cuda_fusions("local", 1, "yarn" if yarn else "rope", on_cuda=on)
        assert fusions["apply_rope_fusion"] == (on and yarn)
        model = build_model(cfg, layout, seq_length=64, **fusions).cuda()
        assert model.config.bias_dropout_fusion == on
        tokens = torch.randint(0, TINY.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
        logits, _ = composer_forward(model, tokens, torch.arange(64, device="cuda").expand(2, 64))
        logits.float().logsumexp(-1).mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
