"""HF DeepSeek-V3 <-> megatron-composer checkpoint conversion.

The reference is transformers' own `DeepseekV3ForCausalLM` (and its generic
`MtpModel` for the MTP head, which follows the published DeepSeek-V3 layer
`num_hidden_layers + k`): small random models are saved with
`save_pretrained`, converted, and our logits must equal theirs; converted
back, every tensor must be bit-identical to what was saved.
"""
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_composer.config import get_preset
from megatron_composer.convert import (
    ConversionError,
    checkpoint_logits,
    dequantize_fp8_blocks,
    hf_config_from_model,
    hf_to_mcore,
    mcore_to_hf,
    model_config_from_hf,
    quantize_fp8_blocks,
)
from tests.distributed import run_distributed

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers, the reference implementation, is not installed (pip install -e '.[test]')",
)


def _transformers():
    """transformers' DeepSeek-V3 classes, imported on first use (spawned ranks never need them)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    return DeepseekV3Config, DeepseekV3ForCausalLM, MtpModel


SEQ = 24
BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.1,
    num_nextn_predict_layers=0, tie_word_embeddings=False,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# The variants the converter must get exactly right, each against transformers.
VARIANTS = {
    # q LoRA, 1 dense layer, group-limited routing, scaling 2.5, expert bias, YaRN, MTP.
    "full": dict(rope_scaling=YARN, num_nextn_predict_layers=1),
    # plain q projection, no dense layer, no groups, scaling 1, tied embeddings,
    # rope_theta 50000, non-interleaved rope rows.
    "plain": dict(q_lora_rank=None, first_k_dense_replace=0, n_group=1, topk_group=1,
                  num_experts_per_tok=2, routed_scaling_factor=1.0, tie_word_embeddings=True,
                  rope_theta=50000.0, rope_interleave=False),
    # two dense layers of three, YaRN without mscale_all_dim, experts stored fused.
    "fused": dict(num_hidden_layers=3, first_k_dense_replace=2, n_group=2, topk_group=1,
                  num_experts_per_tok=2, rope_scaling=dict(YARN, factor=8.0, mscale_all_dim=0.0,
                                                           beta_fast=16)),
    # no MoE layer at all.
    "dense": dict(first_k_dense_replace=2),
}


def _hf_config(**overrides):
    kw = dict(BASE, **overrides)
    scaling = kw.pop("rope_scaling", None)
    theta = kw.pop("rope_theta", 10000.0)
    rope = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    return _transformers()[0](rope_parameters=rope, attn_implementation="eager", **kw)


def _randomize(module, seed):
    """Norms and router biases away from their 1 / 0 init, so swapped or
    dropped ones change the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.6 - 0.3)


def make_hf(seed=0, **overrides):
    """(transformers model, its MtpModel or None), random, fp32, eval."""
    _, causal_lm, mtp_model = _transformers()
    torch.manual_seed(seed)
    config = _hf_config(**overrides)
    model = causal_lm(config).eval()
    _randomize(model, seed)
    mtp = None
    if config.num_nextn_predict_layers:
        mtp = mtp_model(model, config.num_nextn_predict_layers).eval()
        torch.manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in mtp.named_parameters():
                if not name.startswith(("embed_tokens", "shared_head")):
                    p.normal_(0, 0.1)
        _randomize(mtp, seed + 1)
    return model, mtp


def _per_expert(prefix, state, key, value):
    """transformers' fused experts -> published per-expert tensors."""
    if key.endswith("mlp.experts.gate_up_proj"):
        half = value.shape[1] // 2
        for e in range(value.shape[0]):
            state[f"{prefix}{key[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = value[e, :half].clone()
            state[f"{prefix}{key[:-len('gate_up_proj')]}{e}.up_proj.weight"] = value[e, half:].clone()
    elif key.endswith("mlp.experts.down_proj"):
        for e in range(value.shape[0]):
            state[f"{prefix}{key[:-len('down_proj')]}{e}.down_proj.weight"] = value[e].clone()
    else:
        state[prefix + key] = value.detach().clone()


def mtp_tensors(model, mtp):
    """MTP weights under the published names: decoder layer num_hidden_layers + k."""
    layers = model.config.num_hidden_layers
    state = {}
    for key, value in mtp.state_dict().items():
        if key.startswith(("embed_tokens", "shared_head")):
            continue
        _, k, rest = key.split(".", 2)
        prefix = f"model.layers.{layers + int(k)}."
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        _per_expert(prefix, state, rest, value)
    for k in range(mtp.num_mtp_layers):
        state[f"model.layers.{layers + k}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        state[f"model.layers.{layers + k}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return state


def _add_shard(path, name, tensors):
    save_file(tensors, os.path.join(path, name))
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update({k: name for k in tensors})
    with open(index_path, "w") as f:
        json.dump(index, f)


def fuse_experts(state, model):
    """Published per-expert tensors -> transformers' fused expert parameters."""
    state = dict(state)
    for key, param in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base, kind = key.rsplit(".", 1)
            n = param.shape[0]
            if kind == "gate_up_proj":
                state[key] = torch.stack([torch.cat([state.pop(f"{base}.{e}.gate_proj.weight"),
                                                     state.pop(f"{base}.{e}.up_proj.weight")]) for e in range(n)])
            else:
                state[key] = torch.stack([state.pop(f"{base}.{e}.down_proj.weight") for e in range(n)])
    return state


def load_hf(path):
    """transformers' model for an HF directory, built from its config.json.

    Not `from_pretrained`: once megatron-composer's CPU shims replaced
    `torch.arange` & co., `with torch.device("meta")` no longer reaches them and
    from_pretrained leaves RoPE's `inv_freq` uninitialized (see
    `platform.cpu`'s device_cuda_literal shim).
    """
    config, causal_lm, _ = _transformers()
    model = causal_lm(config.from_pretrained(path, attn_implementation="eager")).eval()
    layers = model.config.num_hidden_layers
    state = {k: v for k, v in read_all(path).items()  # without the MTP layers
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, unexpected = model.load_state_dict(fuse_experts(state, model), strict=False)
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= allowed, (missing, unexpected)
    return model


def save_hf(model, mtp, path):
    model.save_pretrained(path, max_shard_size="200KB")
    if mtp is not None:
        _add_shard(path, "model-mtp.safetensors", mtp_tensors(model, mtp))


def read_all(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _tokens(seed=1):
    return torch.randint(0, BASE["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, mtp, tokens):
    """Main logits [s, V] and, with MTP, MTP-depth-1 logits [s-1, V] (position t
    combines the main hidden state at t with the embedding of token t+1)."""
    ids = tokens[None]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        main = out.logits[0].float()
        if mtp is None:
            return main, None
        hidden = out.hidden_states[-1][:, :-1]
        pos = torch.arange(SEQ - 1)[None]
        h = mtp.forward_layer(0, hidden, pos, None, input_ids=ids[:, 1:])
        return main, mtp._project_to_logits(h)[0].float()


def assert_same_tensors(original, exported):
    assert set(original) == set(exported), set(original) ^ set(exported)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype, key
        assert torch.equal(exported[key], value), key


@needs_transformers
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_roundtrip_logit_parity(variant, tmp_path):
    model, mtp = make_hf(**VARIANTS[variant])
    hf_dir, ours, back = tmp_path / "hf", str(tmp_path / "mc"), str(tmp_path / "back")
    save_hf(model, mtp, hf_dir)
    if variant == "fused":  # transformers' in-memory layout: mlp.experts.gate_up_proj [E, 2I, H]
        for name in os.listdir(hf_dir):
            if name.endswith(".safetensors") or name == "model.safetensors.index.json":
                os.remove(hf_dir / name)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, hf_dir / "model.safetensors")
    original = {}
    for k, v in read_all(hf_dir).items():
        _per_expert("", original, k, v)

    cfg = hf_to_mcore(str(hf_dir), ours, progress=False, max_file_bytes=64 << 10)
    assert cfg.mtp_num_layers == (1 if mtp is not None else 0)
    tokens = _tokens()
    ref, ref_mtp = hf_logits(model, mtp, tokens)
    got = checkpoint_logits(ours, tokens, include_mtp=True)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(got[0], ref, rtol=0, atol=1e-4)
    if mtp is not None:
        torch.testing.assert_close(got[1, :-1], ref_mtp, rtol=0, atol=1e-4)

    hf_cfg = mcore_to_hf(ours, back, progress=False, max_shard_bytes=100 << 10)
    assert_same_tensors(original, read_all(back))
    assert model_config_from_hf(hf_cfg, mtp_layers=cfg.mtp_num_layers) == cfg
    if variant in ("full", "plain"):  # the exported config.json is one transformers reads right
        reloaded = load_hf(back)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(tokens[None]).logits[0], ref, rtol=0, atol=0)


@needs_transformers
def test_fp8_checkpoint_is_dequantized(tmp_path):
    """FP8 e4m3 weights with 128x128 block scales (ragged edges): our model
    equals transformers loaded with the dequantized weights; export writes
    the dequantized values and no scales."""
    model, _ = make_hf(hidden_size=160, intermediate_size=200, moe_intermediate_size=136, seed=3)
    hf_dir = tmp_path / "hf"
    save_hf(model, None, hf_dir)
    state = read_all(hf_dir)
    quantized, dequantized = {}, {}
    for key, value in state.items():
        if value.ndim == 2 and "embed_tokens" not in key and "lm_head" not in key and ".gate." not in key:
            q, s = quantize_fp8_blocks(value)
            quantized[key], quantized[key[:-len("weight")] + "weight_scale_inv"] = q, s
            dequantized[key] = dequantize_fp8_blocks(q, s, dtype=torch.float32)
        else:
            quantized[key] = dequantized[key] = value
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(hf_dir / name)
    save_file(quantized, hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (hf_dir / "config.json").write_text(json.dumps(config))

    ours, back = str(tmp_path / "mc"), str(tmp_path / "back")
    hf_to_mcore(str(hf_dir), ours, fp8_dtype=torch.float32, progress=False)
    reference = copy.deepcopy(model)
    reference.load_state_dict(fuse_experts(dequantized, model), strict=True)
    tokens = _tokens()
    ref, _ = hf_logits(reference, None, tokens)
    assert not torch.allclose(ref, hf_logits(model, None, tokens)[0], atol=1e-3)  # FP8 made a difference
    torch.testing.assert_close(checkpoint_logits(ours, tokens), ref, rtol=0, atol=1e-4)
    mcore_to_hf(ours, back, progress=False)
    assert_same_tensors(dequantized, read_all(back))
    assert "quantization_config" not in json.loads(open(os.path.join(back, "config.json")).read())


def test_dequantize_fp8_blocks_matches_blockwise_reference():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 200, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) + 0.01
    want = torch.empty(300, 200)
    for i in range(3):
        for j in range(2):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            want[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = block * s[i, j]
    torch.testing.assert_close(dequantize_fp8_blocks(w, s, dtype=torch.float32), want, rtol=0, atol=0)
    assert torch.equal(dequantize_fp8_blocks(w, s), want.bfloat16())
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2, 2\).*needs \(3, 2\)"):
        dequantize_fp8_blocks(w, s[:2])
    q, scale = quantize_fp8_blocks(want)
    assert scale.shape == (3, 2)
    torch.testing.assert_close(dequantize_fp8_blocks(q, scale, dtype=torch.float32), want, rtol=0.07, atol=0)


def _ep_logits(rank, world, path, tokens):
    from megatron_composer.parallel import ParallelLayout

    return checkpoint_logits(path, tokens, layout=ParallelLayout(world_size=world, ep=world))


@needs_transformers
def test_converted_checkpoint_loads_under_expert_parallelism(tmp_path):
    """Global expert names: a checkpoint converted by one process loads under EP=2."""
    model, _ = make_hf(seed=5)
    save_hf(model, None, tmp_path / "hf")
    ours = str(tmp_path / "mc")
    hf_to_mcore(str(tmp_path / "hf"), ours, expert_model_parallel_size=2, progress=False)
    tokens = _tokens()
    ref, _ = hf_logits(model, None, tokens)
    for logits in run_distributed(_ep_logits, 2, ours, tokens):
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)


# ---------------------------------------------------------------- errors

PUBLISHED_DEEPSEEK_V3 = {  # config.json of deepseek-ai/DeepSeek-V3 (auto_map omitted)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_published_deepseek_v3_config_is_our_preset():
    cfg = model_config_from_hf(PUBLISHED_DEEPSEEK_V3)
    assert cfg == get_preset("deepseek-v3").replace(init_method_std=0.02)
    back = hf_config_from_model(cfg, PUBLISHED_DEEPSEEK_V3)
    assert model_config_from_hf(back) == cfg
    assert "quantization_config" not in back
    kimi = get_preset("kimi-k2.5")
    assert model_config_from_hf(hf_config_from_model(kimi)) == kimi


@pytest.mark.parametrize("patch, key", [
    ({"scoring_func": "sqrtsoftplus"}, "scoring_func"),
    ({"attention_bias": True}, "attention_bias"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"num_experts_per_tok": 4}, "num_experts_per_tok=4 with topk_group=4"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
    ({"rope_scaling": dict(PUBLISHED_DEEPSEEK_V3["rope_scaling"], mscale=0)}, "rope_scaling.mscale"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config.quant_method='awq'"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantization_config.format=None"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"model_type": "deepseek_v32"}, "model_type"),
])
def test_inexpressible_config_names_the_key(patch, key, tmp_path):
    hf = dict(PUBLISHED_DEEPSEEK_V3, **patch)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ConversionError, match=key.replace("(", r"\(").replace(".", r"\.")):
        hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_export_refuses_group_routing_hf_cannot_express():
    with pytest.raises(ConversionError, match="moe_router_topk=2 with moe_router_group_topk=2"):
        # 4 groups, 2 chosen, top-2: megatron scores a group by its top 1 expert
        hf_config_from_model(get_preset("tiny").replace(moe_router_num_groups=4, moe_router_group_topk=2))


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "hf"
    model, _ = make_hf(seed=7)
    save_hf(model, None, path)
    return path


def _edit_tensor(src, dst, key, value):
    """Copy HF checkpoint `src` to `dst` with tensor `key` replaced (None: removed)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][key]
    tensors = read_all_file(dst / shard)
    if value is None:
        del tensors[key], index["weight_map"][key]
    else:
        tensors[key] = value
    save_file(tensors, dst / shard)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def read_all_file(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@needs_transformers
@pytest.mark.parametrize("key, value, message", [
    ("model.layers.1.mlp.experts.3.up_proj.weight", None, "lacks tensor model.layers.1.mlp.experts.3.up_proj"),
    ("model.layers.0.self_attn.kv_b_proj.weight", torch.zeros(128, 17),
     r"model\.layers\.0\.self_attn\.kv_b_proj\.weight has shape \(128, 17\); config.json implies \(128, 16\)"),
    ("model.layers.1.mlp.gate.e_score_correction_bias", None, "lacks tensor .*e_score_correction_bias"),
])
def test_missing_or_misshapen_tensor_names_the_key(small_hf, tmp_path, key, value, message):
    _edit_tensor(small_hf, tmp_path / "hf", key, value)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


@needs_transformers
def test_unexpected_tensor_is_an_error(small_hf, tmp_path):
    shutil.copytree(small_hf, tmp_path / "hf")
    _add_shard(tmp_path / "hf", "extra.safetensors", {"model.layers.0.self_attn.q_norm.weight": torch.ones(4)})
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "out"), progress=False)


@needs_transformers
def test_interrupted_conversion_resumes(small_hf, tmp_path, monkeypatch):
    """A conversion stopped after its first input shard leaves no OUT, only OUT.partial; the
    same command then converts the remaining shards only and gives what an uninterrupted run
    gives. So does an export stopped after its first output shard."""
    from megatron_composer.checkpoint import load_tensors, tensor_specs
    from megatron_composer.convert import export, hf

    def stop_after_first(module, name):
        real, calls = getattr(module, name), []

        def flaky(*args):
            calls.append(args)
            if len(calls) == 2:
                raise OSError("disk full")
            return real(*args)

        monkeypatch.setattr(module, name, flaky)
        return calls

    def count_calls(module, name):
        real, calls = getattr(module, name), []
        monkeypatch.setattr(module, name, lambda *args: (calls.append(args), real(*args))[1])
        return calls

    stop_after_first(hf, "_import_shard")
    out = str(tmp_path / "out")
    with pytest.raises(OSError, match="disk full"):
        hf_to_mcore(str(small_hf), out, progress=False, max_file_bytes=64 << 10)
    assert sorted(os.listdir(tmp_path)) == ["out.partial"]
    monkeypatch.undo()
    rerun = count_calls(hf, "_import_shard")
    hf_to_mcore(str(small_hf), out, progress=False, max_file_bytes=64 << 10)
    monkeypatch.undo()
    uninterrupted = count_calls(hf, "_import_shard")
    fresh = str(tmp_path / "fresh")
    hf_to_mcore(str(small_hf), fresh, progress=False, max_file_bytes=64 << 10)
    assert len(uninterrupted) >= 2 and len(rerun) == len(uninterrupted) - 1  # the finished shard was kept
    it_a, it_b = os.path.join(out, "iter_0000000"), os.path.join(fresh, "iter_0000000")
    specs = tensor_specs(it_a)
    assert specs == tensor_specs(it_b)
    a, b = load_tensors(it_a, specs), load_tensors(it_b, specs)
    assert all(torch.equal(a[k], b[k]) for k in specs)
    assert sorted(os.listdir(tmp_path)) == ["fresh", "out"]

    monkeypatch.undo()
    stop_after_first(export, "_export_shard")
    back = str(tmp_path / "back")
    with pytest.raises(OSError, match="disk full"):
        mcore_to_hf(out, back, progress=False, max_shard_bytes=100 << 10)
    monkeypatch.undo()
    mcore_to_hf(out, back, progress=False, max_shard_bytes=100 << 10)
    assert_same_tensors(read_all(small_hf), read_all(back))


@needs_transformers
def test_export_names_a_tensor_missing_from_our_checkpoint(small_hf, tmp_path):
    ours = str(tmp_path / "mc")
    hf_to_mcore(str(small_hf), ours, progress=False)
    meta_path = os.path.join(ours, "iter_0000000", "meta.json")
    meta = json.load(open(meta_path))
    meta["model_config"]["num_layers"] += 1
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(ConversionError, match=r"lacks tensor decoder\.layers\.2\.input_layernorm\.weight"):
        mcore_to_hf(ours, str(tmp_path / "back"), progress=False)
    assert not os.path.exists(tmp_path / "back")


def _tool(name):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_transformers
def test_command_line_tools(small_hf, tmp_path, capsys):
    convert, logits = _tool("convert_checkpoint"), _tool("logits")
    ours, back, out = str(tmp_path / "mc"), str(tmp_path / "back"), str(tmp_path / "l.pt")
    common = ["--load", str(small_hf), "--save", ours, "--no-progress"]
    assert convert.main(["--direction", "hf-to-mcore", "--expert-model-parallel-size", "3"] + common) == 1
    assert "n_routed_experts=8 is not divisible by --expert-model-parallel-size 3" in capsys.readouterr().err
    assert convert.main(["--direction", "hf-to-mcore", "--expert-model-parallel-size", "2"] + common) == 0
    meta = json.load(open(os.path.join(ours, "iter_0000000", "meta.json")))
    assert meta["args"]["expert_model_parallel_size"] == 2
    assert logits.main(["--load", ours, "--tokens", "1,2,3,4,5", "--out", out]) == 0
    assert torch.equal(torch.load(out), checkpoint_logits(ours, [1, 2, 3, 4, 5]))
    assert convert.main(["--direction", "mcore-to-hf", "--load", ours, "--save", back,
                         "--max-shard-size", "100KiB", "--no-progress"]) == 0
    assert_same_tensors(read_all(small_hf), read_all(back))
    assert os.path.exists(os.path.join(back, "generation_config.json"))  # assets travel along
    capsys.readouterr()
    assert convert.main(["--direction", "mcore-to-hf", "--load", str(tmp_path / "nothing"), "--save",
                         str(tmp_path / "none"), "--no-progress"]) == 1
    assert f"error: no checkpoint in {tmp_path / 'nothing'}: it does not exist" in capsys.readouterr().err
    assert convert.parse_size("5GB") == 5 * 10**9 and convert.parse_size("2MiB") == 2 << 20


# ---------------------------------------------------------------- memory

_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    from megatron_composer.convert import hf_to_mcore, mcore_to_hf

    def peak_growth(fn):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter (VmHWM)
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        before = status("VmRSS")
        fn()
        return status("VmHWM") - before

    hf, ours, back, chunk, warm = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    # One-time costs (lazy imports, allocator pools) are not per-model memory.
    hf_to_mcore(warm, warm + "-mc", max_file_bytes=chunk, progress=False)
    mcore_to_hf(warm + "-mc", warm + "-back", max_shard_bytes=chunk, progress=False)
    up = peak_growth(lambda: hf_to_mcore(hf, ours, max_file_bytes=chunk, progress=False))
    down = peak_growth(lambda: mcore_to_hf(ours, back, max_shard_bytes=chunk, progress=False))
    print(json.dumps({"hf_to_mcore": up, "mcore_to_hf": down}))
""")


def _synthetic_hf(path, hidden=256, experts=24, layers=4):
    """A DeepSeek-V3 checkpoint of random fp32 tensors, written a layer per shard."""
    hf = dict(BASE, hidden_size=hidden, moe_intermediate_size=hidden, intermediate_size=hidden,
              n_routed_experts=experts, num_hidden_layers=layers, n_group=1, topk_group=1,
              vocab_size=1024, rope_theta=10000.0, model_type="deepseek_v3")
    from megatron_composer.convert.keys import tensor_maps

    cfg = model_config_from_hf(hf)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    shards: dict[str, dict] = {}
    for m in tensor_maps(cfg):
        for name, shape in zip(m.hf, m.shapes):
            layer = name.split(".")[2] if name.startswith("model.layers.") else "other"
            shards.setdefault(layer, {})[name] = shape
    weight_map, total = {}, 0
    for layer, tensors in shards.items():
        fname = f"layer-{layer}.safetensors"
        data = {k: torch.randn(s) for k, s in tensors.items()}
        total += sum(t.numel() * 4 for t in data.values())
        save_file(data, path / fname)
        weight_map.update({k: fname for k in tensors})
        del data
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_conversion_memory_is_bounded(tmp_path):
    total = _synthetic_hf(tmp_path / "hf")
    _synthetic_hf(tmp_path / "warm", experts=4, layers=2)
    bound = 10 << 20
    assert total > 5 * bound  # the model is several times the bound
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path / "hf"), str(tmp_path / "mc"),
         str(tmp_path / "back"), str(1 << 20), str(tmp_path / "warm")],
        capture_output=True, text=True, cwd=root, env=dict(os.environ, PYTHONPATH=root), timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    growth = json.loads(out.stdout.strip().splitlines()[-1])
    assert growth["hf_to_mcore"] < bound, (growth, total)
    assert growth["mcore_to_hf"] < bound, (growth, total)


@pytest.mark.parametrize("preset", ["tiny", "small", "deepseek-v3", "kimi-k2.5"])
def test_every_preset_is_expressible_in_the_hf_format(preset):
    from megatron_composer.config import get_preset
    from megatron_composer.convert.config import hf_config_from_model, model_config_from_hf

    cfg = get_preset(preset)
    back = model_config_from_hf(hf_config_from_model(cfg))
    assert back.replace(init_method_std=cfg.init_method_std) == cfg
