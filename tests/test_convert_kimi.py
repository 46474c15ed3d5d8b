"""Kimi K2.5's published layout, in and out.

A tiny checkpoint in exactly that layout is built here with the
`compressed-tensors` library itself: a `kimi_k25` wrapper config whose
`text_config` is a DeepSeek-V3 model (transformers' `DeepseekV3ForCausalLM`,
random), the text tensors under `language_model.`, the routed experts packed
by compressed-tensors to symmetric INT4 (group 32, `weight_packed` /
`weight_scale` / `weight_shape`), and a stub vision tower and projector of
mixed dtypes. The references are the libraries, not our code: compressed-
tensors' own checkpoint dequantizer (`CompressedTensorsDequantizer`) and
packer, and transformers' DeepseekV3 for the logits.
"""
import copy
import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_composer.convert import (
    ConversionError,
    checkpoint_logits,
    hf_to_mcore,
    mcore_to_hf,
    model_config_from_hf,
)
from tests.test_kimi_tokenizer import write_kimi_tokenizer
from tests.test_convert import (
    YARN,
    _per_expert,
    _tokens,
    fuse_experts,
    hf_logits,
    make_hf,
    needs_transformers,
    read_all,
)

compressed_tensors = pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors, the INT4 reference, is not installed (pip install -e '.[test]')")

PREFIX = "language_model."
# Kimi K2.5's text backbone in miniature: one dense layer, no expert groups, top-2 of 8.
# Its vocabulary: the small tokenizer's 360 base tokens and Kimi's 256 named special ids.
KIMI_TEXT = dict(n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=2.827,
                 rope_scaling=YARN, moe_intermediate_size=32, vocab_size=360 + 256)
INT4_CONFIG = {  # the published scheme (Kimi K2-Thinking / K2.5 config.json)
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}}}},
    "ignore": ["language_model.lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def _scheme():
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(copy.deepcopy(INT4_CONFIG)).config_groups["group_0"]


def ct_pack(weight):
    """compressed-tensors' own INT4 packing of `weight`: its dynamic min-max scales, its compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    scheme = _scheme()
    scale, zero = compute_dynamic_scales_and_zp(weight, scheme.weights, module=None)
    return BaseCompressor.get_value_from_registry("pack-quantized").compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)


def ct_dequantize(path):
    """Every tensor of an HF directory, INT4 ones dequantized by compressed-tensors' checkpoint
    dequantizer (which reads config.json's text_config.quantization_config like vLLM)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    return CompressedTensorsDequantizer(str(path)).validate(read_all(path))


def vision_stub(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 2, 2, generator=g).bfloat16(),
        "vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(48, 16, generator=g).bfloat16(),
        "vision_tower.encoder.blocks.0.norm0.weight": torch.rand(16, generator=g),  # fp32
        "vision_tower.pos_emb.time_weight": torch.randn(4, 1, 16, generator=g).half(),
        "mm_projector.pre_norm.weight": torch.rand(64, generator=g).bfloat16(),
        "mm_projector.proj.0.weight": torch.randn(64, 64, generator=g).bfloat16(),
        "mm_projector.proj.2.bias": torch.randn(64, generator=g).bfloat16(),
    }


def write_kimi(path, seed=0, int4=True, quant=None, **overrides):
    """A Kimi-K2.5-layout checkpoint; returns (transformers model, the vision stub tensors)."""
    model, _ = make_hf(seed=seed, **dict(KIMI_TEXT, **overrides))
    path.mkdir(parents=True)
    state = {}
    for key, value in model.state_dict().items():
        _per_expert("", state, key, value)
    tensors = {}
    for key, value in state.items():
        if int4 and ".mlp.experts." in key:
            module = key[: -len(".weight")]
            packed = ct_pack(value.bfloat16())
            tensors.update({f"{PREFIX}{module}.{k}": v for k, v in packed.items()})
        else:
            tensors[PREFIX + key] = value.contiguous()
    vision = vision_stub(seed)
    tensors.update(vision)
    # several shards, vision and text mixed, as the published index spreads them
    names = sorted(tensors)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: tensors[k] for k in part}, path / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = model.config.to_dict()
    text.pop("rope_parameters", None)
    text.update(model_type="kimi_k2", rope_theta=10000.0, rope_scaling=YARN,
                architectures=["DeepseekV3ForCausalLM"])
    if int4 or quant:
        text["quantization_config"] = quant or INT4_CONFIG
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "media_placeholder_token_id": 163605, "pad_token_id": 163839, "bos_token_id": 163584,
        "eos_token_id": 163585, "use_unified_vision_chunk": True, "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"patch_size": 14, "vt_hidden_size": 16, "mm_hidden_size": 16, "text_hidden_size": 64},
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "configuration_kimi_k25.py").write_text("# remote code travels with the weights\n")
    assert write_kimi_tokenizer(path, vocab=360) == 360
    return model, vision


def _sha(t):
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi") / "hf"
    model, vision = write_kimi(path)
    return path, model, vision


@needs_transformers
def test_import_dequantizes_int4_like_compressed_tensors_and_logits_match(kimi, tmp_path):
    path, model, vision = kimi
    reference = ct_dequantize(path)
    text = {k[len(PREFIX):]: v.float() for k, v in reference.items() if k.startswith(PREFIX)}
    assert all(k in reference for k in vision)
    dequantized = copy.deepcopy(model)
    dequantized.load_state_dict(fuse_experts(text, model), strict=True)
    tokens = _tokens()
    ref, _ = hf_logits(dequantized, None, tokens)
    assert not torch.allclose(ref, hf_logits(model, None, tokens)[0], atol=1e-3)  # INT4 made a difference

    ours = str(tmp_path / "mc")
    cfg = hf_to_mcore(str(path), ours, progress=False, max_file_bytes=64 << 10)
    assert cfg.num_experts == 8 and cfg.moe_router_topk == 2
    got = checkpoint_logits(ours, tokens)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    meta = json.load(open(os.path.join(ours, "iter_0000000", "meta.json")))
    assert meta["conversion"]["int4_dequantized"] and meta["conversion"]["kept_aside_tensors"] == len(vision)
    manifest = json.load(open(os.path.join(ours, "hf_multimodal", "manifest.json")))["tensors"]
    assert set(manifest) == set(vision)
    for key, tensor in vision.items():
        entry = manifest[key]
        assert (entry["dtype"], entry["shape"], entry["sha256"]) == (
            str(tensor.dtype).replace("torch.", ""), list(tensor.shape), _sha(tensor))
    assert os.path.exists(os.path.join(ours, "hf_assets", "configuration_kimi_k25.py"))


@pytest.fixture(scope="module")
def kimi_bf16(tmp_path_factory, kimi):
    """The Kimi checkpoint imported in bf16, and its default (bf16) export."""
    path, _, _ = kimi
    root = tmp_path_factory.mktemp("kimi_bf16")
    ours, back = str(root / "mc"), str(root / "back")
    hf_to_mcore(str(path), ours, dtype=torch.bfloat16, progress=False, max_file_bytes=64 << 10)
    mcore_to_hf(ours, back, progress=False, max_shard_bytes=100 << 10)
    return ours, back


@needs_transformers
def test_export_restores_the_layout_and_reimports_bit_exact(kimi, kimi_bf16, tmp_path):
    path, _, vision = kimi
    ours, back = kimi_bf16
    source = json.load(open(path / "config.json"))
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["model_type"] == "kimi_k25" and config["architectures"] == source["architectures"]
    assert config["vision_config"] == source["vision_config"]
    assert config["media_placeholder_token_id"] == 163605
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    for key in ("hidden_size", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "model_type"):
        assert config["text_config"][key] == source["text_config"][key], key
    assert model_config_from_hf(config["text_config"]) == model_config_from_hf(source["text_config"])
    exported = read_all(back)
    reference = ct_dequantize(path)
    assert set(exported) == set(reference)  # text under language_model., vision at the top level
    for key, tensor in vision.items():
        assert exported[key].dtype == tensor.dtype and _sha(exported[key]) == _sha(tensor), key
    for key, value in reference.items():  # bf16 export = the dequantized weights, in bf16
        if key.startswith(PREFIX):
            assert torch.equal(exported[key], value.bfloat16()), key
    assert os.path.exists(os.path.join(back, "configuration_kimi_k25.py"))

    again, back2 = str(tmp_path / "mc2"), str(tmp_path / "back2")
    hf_to_mcore(back, again, progress=False)
    from megatron_composer.checkpoint import load_tensors, tensor_specs

    first, second = tensor_specs(os.path.join(ours, "iter_0000000")), tensor_specs(os.path.join(again, "iter_0000000"))
    assert first == second
    a = load_tensors(os.path.join(ours, "iter_0000000"), first)
    b = load_tensors(os.path.join(again, "iter_0000000"), second)
    for key in a:
        assert a[key].dtype == torch.bfloat16 and torch.equal(a[key], b[key]), key
    mcore_to_hf(again, back2, progress=False)
    for key, value in read_all(back2).items():
        assert torch.equal(value, exported[key]) and value.dtype == exported[key].dtype, key


def check_ct_packing(exported, bf16, experts):
    """Every INT4 expert of `exported` is compressed-tensors' quantization and packing of the bf16
    weight with the exported scales, and no group's scale is worse than its min-max observer's.
    Returns the relative Frobenius error of the INT4 weights against the bf16 ones."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    scheme = _scheme()
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    num = den = 0.0
    for key in experts:
        module, weight = key[: -len(".weight")], bf16[key]
        got = {p: exported[f"{module}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
        want = compressor.compress({"weight": weight, "weight_scale": got["weight_scale"]}, scheme)
        for part in got:
            assert got[part].dtype == want[part].dtype and torch.equal(got[part], want[part]), (module, part)
        assert key not in exported
        minmax, zero = compute_dynamic_scales_and_zp(weight, scheme.weights, module=None)

        def group_error(scale):
            diff = fake_quantize(weight, scale, zero, scheme.weights).float() - weight.float()
            return diff.pow(2).unflatten(-1, (-1, 32)).sum(-1)

        assert (group_error(got["weight_scale"]) <= group_error(minmax)).all(), module
        dequantized = compressor.decompress(got, scheme)["weight"].float()
        num += (dequantized - weight.float()).pow(2).sum().item()
        den += weight.float().pow(2).sum().item()
    return (num / den) ** 0.5


@needs_transformers
def test_export_int4_is_compressed_tensors_own_packing(kimi, kimi_bf16, tmp_path):
    """An unchanged import comes back as the published INT4, bit for bit; the export is read by
    compressed-tensors like the published checkpoint; off-grid weights (a model that trained away
    from the grid: here a bf16 source) are packed by compressed-tensors with scales no worse than
    its min-max observer's."""
    path, _, vision = kimi
    ours, back = kimi_bf16
    int4 = str(tmp_path / "int4")
    mcore_to_hf(ours, int4, progress=False, export_int4=True)
    config = json.load(open(os.path.join(int4, "config.json")))
    assert config["text_config"]["quantization_config"] == INT4_CONFIG
    exported, bf16, source = read_all(int4), read_all(back), read_all(path)
    experts = [k for k in bf16 if ".mlp.experts." in k]
    assert len(experts) == 1 * 8 * 3
    assert set(exported) == set(source)
    for key, tensor in source.items():  # the published INT4 and the vision parts back, bit for bit
        if ".mlp.experts." in key or key in vision:
            assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
        else:  # the source's fp32 text tensors, as imported in bf16
            assert torch.equal(exported[key], bf16[key]), key
    assert check_ct_packing(exported, bf16, experts) == 0.0
    assert set(ct_dequantize(int4)) == set(ct_dequantize(path))

    plain = tmp_path / "plain"  # bf16 experts: nowhere near an INT4 grid
    write_kimi(plain, seed=3, int4=False)
    hf_to_mcore(str(plain), str(tmp_path / "mc"), dtype=torch.bfloat16, progress=False)
    mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "int4b"), progress=False, export_int4=True)
    config = json.load(open(tmp_path / "int4b" / "config.json"))
    assert config["text_config"]["quantization_config"]["format"] == "pack-quantized"
    exported, source = read_all(tmp_path / "int4b"), read_all(plain)
    experts = [k for k in source if ".mlp.experts." in k]
    error = check_ct_packing(exported, {k: v.bfloat16() for k, v in source.items()}, experts)
    assert 0.05 < error < 0.12, error  # int4 with 32-element groups on Gaussian weights (README)
    reference = ct_dequantize(tmp_path / "int4b")  # compressed-tensors reads it; only the experts were packed
    packed = {k for k in exported if k.endswith(".weight_packed")}
    assert packed == {k[: -len("weight")] + "weight_packed" for k in experts}
    assert all(not k.endswith(".weight_packed") for k in reference)
    for key, tensor in vision_stub(3).items():
        assert _sha(exported[key]) == _sha(tensor)


def test_unsupported_quantization_method_is_named(tmp_path):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    write_kimi(tmp_path / "gptq", int4=False, quant=gptq)
    with pytest.raises(ConversionError, match=r"quant_method='gptq' is not read.*Dequantize the checkpoint to bf16"):
        hf_to_mcore(str(tmp_path / "gptq"), str(tmp_path / "out"), progress=False)
    marlin = dict(INT4_CONFIG, format="marlin-24")
    write_kimi(tmp_path / "marlin", int4=True, quant=marlin)
    with pytest.raises(ConversionError, match=r"quantization_config\.format='marlin-24'.*only 'pack-quantized'"):
        hf_to_mcore(str(tmp_path / "marlin"), str(tmp_path / "out"), progress=False)
    asym = copy.deepcopy(INT4_CONFIG)
    asym["config_groups"]["group_0"]["weights"]["symmetric"] = False
    write_kimi(tmp_path / "asym", int4=True, quant=asym)
    with pytest.raises(ConversionError, match=r"config_groups\.group_0\.weights.*symmetric"):
        hf_to_mcore(str(tmp_path / "asym"), str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_vision_file_changed_after_import_is_refused_on_export(kimi, kimi_bf16, tmp_path):
    import shutil

    from safetensors import safe_open

    ours, _ = kimi_bf16
    copy_dir = tmp_path / "mc"
    shutil.copytree(ours, copy_dir)
    mm = copy_dir / "hf_multimodal"
    fname = sorted(n for n in os.listdir(mm) if n.endswith(".safetensors"))[0]
    with safe_open(mm / fname, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key].reshape(-1)[0] += 1
    save_file(tensors, mm / fname)
    with pytest.raises(ConversionError, match=f"{key} in .*the manifest says"):
        mcore_to_hf(str(copy_dir), str(tmp_path / "back"), progress=False)


def test_the_tokenizer_travels_with_the_checkpoint(kimi, kimi_bf16, tmp_path):
    """Import keeps tiktoken.model + tokenizer_config.json; the checkpoint's tokenizer is Kimi's
    (so preprocessing, the chat template and the server use it); training's copy of it
    (`copy_tokenizer`) keeps its special tokens; export writes both files back."""
    import shutil

    from megatron_composer.checkpoint import checkpoint_tokenizer
    from megatron_composer.checkpoint.tracker import copy_tokenizer
    from megatron_composer.data.tiktoken_tokenizer import TiktokenTokenizer
    from megatron_composer.data.tokenizer import Tokenizer

    path, _, _ = kimi
    ours, back = kimi_bf16
    carried = checkpoint_tokenizer(ours)
    assert carried == os.path.join(ours, "hf_assets", "tiktoken.model")
    tok = Tokenizer(carried)
    assert isinstance(tok, TiktokenTokenizer)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert open(os.path.join(back, name), "rb").read() == (path / name).read_bytes()
    assert not os.path.exists(os.path.join(back, "tokenizer.model"))

    trained = tmp_path / "trained"  # a training run's first save copies the tokenizer to its root
    shutil.copytree(ours, trained)
    assert copy_tokenizer(str(trained), carried)
    assert checkpoint_tokenizer(str(trained)) == str(trained / "tokenizer.model")
    again = Tokenizer(checkpoint_tokenizer(str(trained)))
    assert again.chat == tok.chat and again.encode("def f(): pass") == tok.encode("def f(): pass")
    mcore_to_hf(str(trained), str(tmp_path / "back"), progress=False)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (path / name).read_bytes()


def test_parallel_conversion_through_the_command_line_equals_serial(kimi, kimi_bf16, tmp_path, capsys):
    """--workers 2 (spawned processes, one input / output shard each) gives the same checkpoint and
    the same export as one process."""
    from megatron_composer.checkpoint import load_tensors, tensor_specs
    from tests.test_convert import _tool

    path, _, _ = kimi
    ours, back = kimi_bf16
    convert = _tool("convert_checkpoint")
    par, par_back = str(tmp_path / "mc"), str(tmp_path / "back")
    assert convert.main(["--direction", "hf-to-mcore", "--load", str(path), "--save", par, "--dtype", "bf16",
                         "--workers", "2", "--max-shard-size", "64KiB", "--no-progress"]) == 0
    it_a, it_b = os.path.join(ours, "iter_0000000"), os.path.join(par, "iter_0000000")
    specs = tensor_specs(it_a)
    assert tensor_specs(it_b) == specs
    a, b = load_tensors(it_a, specs), load_tensors(it_b, specs)
    assert all(torch.equal(a[k], b[k]) for k in specs)
    assert convert.main(["--direction", "mcore-to-hf", "--load", par, "--save", par_back, "--workers", "2",
                         "--max-shard-size", "100KiB", "--no-progress"]) == 0
    serial, parallel = read_all(back), read_all(par_back)
    assert set(serial) == set(parallel) and all(torch.equal(serial[k], parallel[k]) for k in serial)
    capsys.readouterr()
    assert convert.main(["--direction", "hf-to-mcore", "--load", str(path), "--save", str(tmp_path / "x"),
                         "--export-int4", "--no-progress"]) == 1
    assert "--export-int4 is an option of --direction mcore-to-hf" in capsys.readouterr().err


def test_the_server_chats_in_kimis_template(kimi, kimi_bf16):
    """The OpenAI server on the imported checkpoint with the tokenizer it carries: the prompt is Kimi's
    chat template, the turn stops at <|im_end|>."""
    import httpx

    from megatron_composer.checkpoint import checkpoint_tokenizer
    from megatron_composer.inference.engine import Engine
    from megatron_composer.inference.server import create_app
    from tests.serving import serve
    from tests.test_kimi_tokenizer import reference_encoding

    path, _, _ = kimi
    ours, _ = kimi_bf16
    engine = Engine.from_checkpoint(ours, tokenizer=checkpoint_tokenizer(ours), max_batch_size=2, max_model_len=128)
    try:
        with serve(create_app(engine, model_name="k25")) as url:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "k25", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():"}]})
    finally:
        engine.stop()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = reference_encoding(path, 360)
    want = ref.encode("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>def f():"
                      "<|im_end|><|im_assistant|>assistant<|im_middle|>", allowed_special="all")
    assert choice["prompt_token_ids"] == want
    assert len(choice["token_ids"]) == 4 or choice["token_ids"][-1] in (360 + 1, 360 + 2)
