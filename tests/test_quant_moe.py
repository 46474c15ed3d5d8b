"""Quantized MoE: experts against megatron and a per-expert reference, NVFP4 CPT, MXFP8 dispatch at EP=2."""
import pytest
import torch
import torch.nn.functional as F

from megatron_composer.config import get_preset
from megatron_composer.moe import check_dispatch_hidden_size, check_expert_precision
from megatron_composer.quant import MXFP8_BLOCK, fake_quantize, quantized_linear
from tests.distributed import run_distributed

TINY = get_preset("tiny")


def _init_world1():
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    init_distributed()
    initialize_parallel(ParallelLayout(world_size=1), seed=1234)


def _experts(precision, params_dtype=torch.float32):
    """(megatron SequentialMLP, ours in `precision`) with the same weights, built from the MoE layer spec."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_composer.models import transformer_config
    from megatron_composer.models.builder import composer_block_spec
    from megatron_composer.moe import QuantizedSequentialMLP

    _init_world1()
    tconfig = transformer_config(TINY, params_dtype=params_dtype)
    pg = get_default_pg_collection()
    spec = composer_block_spec(tconfig, grouped_experts=False).layer_specs[-1].submodules.mlp.submodules.experts
    megatron = build_module(spec, TINY.num_experts, tconfig, pg_collection=pg)
    ours = build_module(ModuleSpec(module=QuantizedSequentialMLP, params={"precision": precision},
                                   submodules=spec.submodules),
                        TINY.num_experts, tconfig, pg_collection=pg)
    ours.load_state_dict(megatron.state_dict())
    return megatron, ours


def _permuted_tokens(dtype, tokens_per_expert=(5, 0, 9, 1, 3, 7, 2, 4)):
    """Dispatched-token inputs: x [T, hidden], tokens_per_expert [E] (CPU int64), probs [T] fp32."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(tokens_per_expert)
    x = torch.randn(int(counts.sum()), TINY.hidden_size, generator=g).to(dtype).requires_grad_()
    probs = torch.rand(int(counts.sum()), generator=g).requires_grad_()
    return x, counts, probs


def _run(experts, x, counts, probs, grad_seed=1):
    """Output and the gradients of x, probs and every expert weight for a fixed upstream gradient."""
    out, bias = experts(x, counts, probs)
    assert bias is None
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    params = dict(experts.named_parameters())
    grads = torch.autograd.grad(out, [x, probs, *params.values()], grad)
    return out.detach(), dict(zip(["x", "probs", *params], grads))


# ------------------------------------------------------------------ experts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_experts_equal_megatron_sequential_mlp(dtype):
    megatron, ours = _experts("bf16", dtype)
    x, counts, probs = _permuted_tokens(dtype)
    ref_out, ref_grads = _run(megatron, x, counts, probs)
    out, grads = _run(ours, x, counts, probs)
    assert out.dtype == dtype
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def _reference_experts(x, counts, probs, weights, precision):
    """Hand-written SequentialMLP: per expert quantized fc1, SwiGLU, * prob, quantized fc2."""
    outs = []
    for i, (xe, pe) in enumerate(zip(torch.split(x, counts.tolist()), torch.split(probs, counts.tolist()))):
        h = quantized_linear(xe, weights[f"local_experts.{i}.linear_fc1.weight"], precision)
        gate, up = torch.chunk(h, 2, dim=-1)
        a = (F.silu(gate) * up * pe.unsqueeze(-1)).to(x.dtype)
        outs.append(quantized_linear(a, weights[f"local_experts.{i}.linear_fc2.weight"], precision))
    return torch.cat(outs)


@pytest.mark.parametrize("precision,dtype", [("nvfp4", torch.float32), ("mxfp8", torch.float32),
                                             ("nvfp4", torch.bfloat16)])
def test_quantized_experts_equal_per_expert_reference(precision, dtype):
    megatron, ours = _experts(precision, dtype)
    x, counts, probs = _permuted_tokens(dtype)
    out, grads = _run(ours, x, counts, probs)
    weights = {n: p.detach().clone().requires_grad_() for n, p in ours.named_parameters()}
    ref = _reference_experts(x, counts, probs, weights, precision)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(ref.dtype)
    ref_grads = torch.autograd.grad(ref, [x, probs, *weights.values()], grad)
    assert torch.equal(out, ref.detach())
    for name, ref_grad in zip(["x", "probs", *weights], ref_grads):
        assert torch.equal(grads[name], ref_grad), name
    # and it is quantized: not megatron's unquantized output
    bf16_out, _ = _run(megatron, x, counts, probs)
    assert not torch.equal(out, bf16_out)
    assert (out - bf16_out).norm() / bf16_out.norm() < 0.25


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_non_finite_token_poisons_only_that_token_and_its_expert(precision):
    _, ours = _experts(precision)
    x, counts, probs = _permuted_tokens(torch.float32)
    x = x.detach().clone()
    x[7, 3] = float("nan")  # token 7 is routed to expert 2 (tokens 5..13)
    out, grads = _run(ours, x.requires_grad_(), counts, probs)
    bad_token = torch.arange(x.shape[0]) == 7
    assert torch.isnan(out[bad_token]).all() and torch.isfinite(out[~bad_token]).all()
    for name in ("x", "probs"):
        assert torch.equal(~torch.isfinite(grads[name]).reshape(x.shape[0], -1).all(-1), bad_token), name
    for name, grad in grads.items():
        if name.startswith("local_experts."):
            assert bool(torch.isfinite(grad).all()) is not name.startswith("local_experts.2."), name


def test_quantized_model_keeps_megatron_parameter_names_and_modules():
    from megatron_composer.models import build_model
    from megatron_composer.moe import MXFP8AlltoAllTokenDispatcher, QuantizedSequentialMLP

    _init_world1()
    base = build_model(TINY, seq_length=32)
    quant = build_model(TINY, seq_length=32, moe_expert_precision="nvfp4", moe_dispatch_precision="mxfp8")
    assert {n: p.shape for n, p in base.named_parameters()} == {n: p.shape for n, p in quant.named_parameters()}
    quant.load_state_dict(base.state_dict())  # checkpoints move across precisions
    moe_layers = [m for m in quant.modules() if hasattr(m, "token_dispatcher")]
    assert len(moe_layers) == TINY.num_moe_layers + TINY.mtp_num_layers  # MTP's layer too
    for layer in moe_layers:
        assert type(layer.experts) is QuantizedSequentialMLP and layer.experts.precision == "nvfp4"
        assert type(layer.token_dispatcher) is MXFP8AlltoAllTokenDispatcher
    assert not any(hasattr(m, "precision") for m in base.modules())  # bf16 default: megatron's modules


def test_precision_errors_name_the_size():
    with pytest.raises(ValueError, match="moe_ffn_hidden_size 100.*linear_fc1.*out_features 200"):
        check_expert_precision(128, 100, "nvfp4")
    with pytest.raises(ValueError, match="'fp4'.*bf16"):
        check_expert_precision(128, 96, "fp4")
    check_expert_precision(128, 96, "mxfp8")
    with pytest.raises(ValueError, match="hidden_size 144.*160"):
        check_dispatch_hidden_size(144)
    from types import SimpleNamespace

    from megatron_composer.moe import MXFP8DispatchMoELayer

    config = SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_latent_size=None, hidden_size=144)
    with pytest.raises(ValueError, match="hidden_size 144"):
        MXFP8DispatchMoELayer(config)


# ------------------------------------------------------------------ NVFP4 CPT
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-model", "bf16-model"])
def test_nvfp4_experts_follow_the_unquantized_loss(tiny_cpt_losses, bf16):
    """NVFP4 experts vs unquantized experts in the model's dtype: an fp32 model,
    and a real --bf16 run (bf16 compute, fp32 main weights)."""
    dtype = "bf16" if bf16 else "fp32"
    plain = tiny_cpt_losses(bf16=bf16)  # unquantized, in the model's dtype (shared with test_trainer.py)
    nvfp4 = tiny_cpt_losses(bf16=bf16, expert_precision="nvfp4")
    last_plain, last_nvfp4 = sum(plain[-3:]) / 3, sum(nvfp4[-3:]) / 3
    print(f"{dtype} model, mean of the last 3 of 30 losses: unquantized {last_plain:.4f} "
          f"nvfp4 {last_nvfp4:.4f} ({(last_nvfp4 / last_plain - 1) * 100:+.2f}%)")
    assert last_plain < plain[0] - 1.0  # it trained
    assert abs(last_nvfp4 - last_plain) <= 0.02 * last_plain, (plain, nvfp4)
    assert nvfp4 != plain  # the experts really ran quantized


# ------------------------------------------------------------------ MXFP8 dispatch at EP=2
class _AllToAllRecorder:
    """Wraps torch.distributed.all_to_all_single, recording (dtype, bytes sent) per call."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        import torch.distributed as dist

        self.original = dist.all_to_all_single

        def recording(output, input, *args, **kwargs):
            self.calls.append((input.dtype, input.numel() * input.element_size()))
            return self.original(output, input, *args, **kwargs)

        dist.all_to_all_single = recording
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_to_all_single = self.original


def _dispatch_body(rank, world):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_composer.models import transformer_config
    from megatron_composer.models.builder import composer_block_spec
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    init_distributed()
    layout = ParallelLayout(world_size=2, ep=2)
    initialize_parallel(layout, seed=1234)
    tconfig = transformer_config(TINY, layout, params_dtype=torch.bfloat16)
    layers = {}
    for precision in ("bf16", "mxfp8"):
        spec = composer_block_spec(tconfig, moe_dispatch_precision=precision).layer_specs[-1].submodules.mlp
        layers[precision] = build_module(spec, config=tconfig, layer_number=2)
    layers["mxfp8"].load_state_dict(layers["bf16"].state_dict())
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
    x = torch.randn(16, 2, TINY.hidden_size, generator=g).bfloat16()

    # the dispatch step alone: what crosses the all_to_all, what arrives, what flows back
    sent, received, received_probs, back, calls = {}, {}, {}, {}, {}
    for precision, layer in layers.items():
        probs, routing_map = layer.route(x)
        tokens, permuted_probs = layer.preprocess(x, probs, routing_map)
        tokens = tokens.detach().requires_grad_()
        with _AllToAllRecorder() as rec:
            received[precision], received_probs[precision] = layer.dispatch(tokens, permuted_probs)
        calls[precision] = rec.calls
        sent[precision] = tokens.detach()
        grad = torch.randn(received[precision].shape, generator=torch.Generator().manual_seed(rank)).bfloat16()
        back[precision], = torch.autograd.grad(received[precision], tokens, grad)
    assert torch.equal(sent["mxfp8"], sent["bf16"])  # same routing, same permutation
    t_send, hidden = sent["bf16"].shape
    assert torch.equal(received["mxfp8"], fake_quantize(received["bf16"], "mxfp8"))
    assert not torch.equal(received["mxfp8"], received["bf16"])
    assert torch.equal(received_probs["mxfp8"], received_probs["bf16"])
    assert torch.equal(back["mxfp8"], back["bf16"])  # backward stays unquantized
    probs_call = calls["bf16"][-1]
    assert calls["bf16"] == [(torch.bfloat16, 2 * t_send * hidden), probs_call]
    assert calls["mxfp8"] == [(torch.uint8, t_send * hidden), (torch.uint8, t_send * hidden // MXFP8_BLOCK),
                              probs_call]

    # the whole layer: MXFP8 dispatch moves the output by about the E4M3 rounding (<= 2**-4 relative)
    with torch.no_grad():
        out = {p: layer(x)[0].float() for p, layer in layers.items()}
    rel = ((out["mxfp8"] - out["bf16"]).norm() / out["bf16"].norm()).item()
    assert 0 < rel < 2.0 ** -4, rel
    return {"tokens_sent": t_send, "hidden": hidden, "rel_error": rel,
            "bf16_bytes": calls["bf16"][0][1], "mxfp8_bytes": calls["mxfp8"][0][1] + calls["mxfp8"][1][1],
            "probs_bytes": probs_call[1]}


def test_mxfp8_dispatch_at_ep2_sends_the_mxfp8_payload():
    results = run_distributed(_dispatch_body, 2)
    for r in results:
        print(r)
        assert r["mxfp8_bytes"] / r["bf16_bytes"] == pytest.approx((1 + 1 / 32) / 2)


# ------------------------------------------------------------------ weight quantization cache
def test_expert_weights_are_quantized_once_per_optimizer_step(monkeypatch):
    """Micro-batches reuse the quantized weights; an in-place update, a write behind the version
    counter followed by an optimizer step, or an explicit invalidation re-quantize them; every
    result equals the uncached path bit for bit, forward and backward."""
    from megatron_composer.quant import invalidate_quantized_weights, weights

    _, ours = _experts("nvfp4")
    calls = []
    original = weights.quantize_weight
    monkeypatch.setattr(weights, "quantize_weight", lambda w, fmt: calls.append(fmt) or original(w, fmt))
    per_step = 2 * 2 * TINY.num_experts  # fc1 and fc2, forward and dgrad operands

    def micro_batches(*seeds):
        """Run ours and the uncached reference (which never calls the cache's quantizer); count quantizations."""
        calls.clear()
        for seed in seeds:
            x, counts, probs = _permuted_tokens(torch.float32)
            x = (x.detach() * (1 + seed)).requires_grad_()
            out, grads = _run(ours, x, counts, probs, grad_seed=seed)
            params = {n: p.detach().clone().requires_grad_() for n, p in ours.named_parameters()}
            ref = _reference_experts(x, counts, probs, params, "nvfp4")
            grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed)).to(ref.dtype)
            ref_grads = torch.autograd.grad(ref, [x, probs, *params.values()], grad)
            assert torch.equal(out, ref.detach())
            for name, ref_grad in zip(["x", "probs", *params], ref_grads):
                assert torch.equal(grads[name], ref_grad), name
        return list(calls)

    first = micro_batches(0, 1, 2)
    assert len(first) == per_step and first.count("mxfp8") == per_step // 2  # once per weight and operand
    assert micro_batches(3) == []

    with torch.no_grad():  # in place (an unfused optimizer update, the bf16 copy of fp32 main weights)
        for p in ours.parameters():
            p.add_(0.01)
    assert len(micro_batches(4)) == per_step

    for p in ours.parameters():  # behind the version counter, then an optimizer step
        p.data.mul_(0.5)
    torch.optim.SGD(ours.parameters(), lr=0.0).step()
    assert len(micro_batches(5, 6)) == per_step

    invalidate_quantized_weights()
    assert len(micro_batches(7)) == per_step


def test_cached_weight_quantization_trains_exactly_like_quantizing_every_micro_batch(data_dir, monkeypatch):
    """A --bf16 run (fp32 main weights copied into the bf16 model after each step, DDP grad
    buffers), two micro-batches per step: the cache quantizes each expert operand once per step,
    and the losses equal, bit for bit, a run that quantizes the weights at every use."""
    from megatron_composer.config import MoEPrecisionConfig
    from megatron_composer.data import CPTDataset
    from megatron_composer.quant import weights
    from tests.trainers import make_trainer

    calls = []
    original = weights.quantize_weight
    monkeypatch.setattr(weights, "quantize_weight", lambda w, fmt: calls.append(fmt) or original(w, fmt))

    def losses(steps=3):
        trainer = make_trainer(CPTDataset(str(data_dir / "stdlib_train"), 64, seed=5), bf16=True,
                               moe_precision=MoEPrecisionConfig(moe_expert_precision="nvfp4"))
        linears = sum(hasattr(m, "weight_quant_cache") for m in trainer.model.gpt.modules())
        calls.clear()
        return [trainer.step().lm_loss for _ in range(steps)], len(calls) / steps / linears

    cached, per_linear_and_step = losses()
    assert per_linear_and_step == 2  # the forward and the dgrad operand, for two micro-batches
    monkeypatch.setattr(weights.WeightQuantCache, "get", lambda self, w: weights.QuantizedWeight(weights._key(w)))
    fresh, per_linear_and_step = losses()
    assert per_linear_and_step == 4
    assert cached == fresh
