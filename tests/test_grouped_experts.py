"""Grouped experts: equal to megatron's SequentialMLP (EP=1 and EP=2), same checkpoint names.

Tolerance: every compared tensor satisfies ||ours - megatron|| <= 1e-6 * ||megatron||
(fp32), per tensor (outputs, input/probs gradients, every weight gradient).
"""
import pytest
import torch

from megatron_composer.config import get_preset
from megatron_composer.moe import GroupedSequentialMLP, grouped_linear
from tests.distributed import run_distributed

TINY = get_preset("tiny")
RTOL = 1e-6


def _assert_close(actual, expected, name=""):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    err = (actual.double() - expected.double()).norm().item()
    assert err <= RTOL * expected.double().norm().item(), f"{name}: |diff| {err:.3g}"


def _setup(ep=1):
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    layout = ParallelLayout(world_size=env.world_size, ep=ep)
    initialize_parallel(layout, seed=1234)
    return layout


# ------------------------------------------------------------------ grouped_linear
def _per_group_reference(x, weight, counts):
    """Plain per-group products: [T, in] x [E, out, in] -> [T, out]."""
    return torch.cat([xe @ weight[e].t() for e, xe in enumerate(torch.split(x, counts))])


@pytest.mark.parametrize("dtype,inner,outer", [
    (torch.float32, 16, 24),   # torch._grouped_mm
    (torch.bfloat16, 16, 24),  # torch._grouped_mm
    (torch.float32, 6, 10),    # strides not 16-byte aligned: per-group mm
    (torch.float64, 16, 24),   # dtype _grouped_mm lacks: per-group mm
])
def test_grouped_linear_equals_per_group_products(dtype, inner, outer):
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0]  # empty groups, also at the end
    x = torch.randn(sum(counts), inner, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), outer, inner, generator=g).to(dtype).requires_grad_()
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = grouped_linear(x, w, ends)
    ref = _per_group_reference(x, w, counts)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    tol = RTOL if dtype != torch.bfloat16 else 1e-2
    for name, a, b in (("out", out, ref), ("grad x", gx, rx), ("grad w", gw, rw)):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    assert gw[1].abs().sum() == 0 and gw[4].abs().sum() == 0  # groups without rows


def test_grouped_linear_takes_a_broadcast_gradient():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(2, 4, 8, requires_grad=True)
    grouped_linear(x, w, torch.tensor([2, 6], dtype=torch.int32)).sum().backward()  # stride-0 grad
    torch.testing.assert_close(x.grad, torch.cat([w[0].sum(0).expand(2, 8), w[1].sum(0).expand(4, 8)]).detach())


# ------------------------------------------------------------------ experts module
def _experts_pair(dtype=torch.float32, **overrides):
    """(megatron SequentialMLP, GroupedSequentialMLP) with the same weights, from the MoE layer spec."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_composer.models import transformer_config
    from megatron_composer.models.builder import composer_block_spec

    _setup()
    tconfig = transformer_config(TINY, params_dtype=dtype, **overrides)
    pg = get_default_pg_collection()
    spec = composer_block_spec(tconfig, grouped_experts=False).layer_specs[-1].submodules.mlp.submodules.experts
    assert spec.module is SequentialMLP
    megatron = build_module(spec, TINY.num_experts, tconfig, pg_collection=pg)
    grouped_spec = composer_block_spec(tconfig).layer_specs[-1].submodules.mlp.submodules.experts
    assert grouped_spec.module is GroupedSequentialMLP
    ours = build_module(grouped_spec, TINY.num_experts, tconfig, pg_collection=pg)
    ours.load_state_dict(megatron.state_dict())
    return megatron, ours


def _run(experts, counts, dtype=torch.float32):
    """Output and the gradients of x, probs and every expert weight for a fixed upstream gradient."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), TINY.hidden_size, generator=g).to(dtype).requires_grad_()
    probs = torch.rand(int(counts.sum()), generator=g).requires_grad_()
    out, bias = experts(x, counts, probs)
    assert bias is None
    grad = torch.randn(out.shape, generator=g).to(out.dtype)
    params = dict(experts.named_parameters())
    grads = torch.autograd.grad(out, [x, probs, *params.values()], grad)
    return out.detach(), dict(zip(["x", "probs", *params], grads))


@pytest.mark.parametrize("counts", [
    (5, 0, 9, 1, 3, 7, 2, 4),    # one expert without tokens
    (0, 0, 12, 0, 0, 3, 0, 0),   # most experts idle, the first and last too
    (0,) * 8,                    # no tokens at all
])
def test_grouped_experts_equal_megatron_sequential_mlp(counts):
    megatron, ours = _experts_pair()
    ref_out, ref_grads = _run(megatron, counts)
    out, grads = _run(ours, counts)
    _assert_close(out, ref_out, "output")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _assert_close(grads[name], ref_grads[name], name)
    idle = [e for e, c in enumerate(counts) if c == 0]
    for e in idle:
        assert grads[f"local_experts.{e}.linear_fc1.weight"].abs().sum() == 0


def test_grouped_experts_apply_probs_on_input_like_megatron():
    megatron, ours = _experts_pair(moe_apply_probs_on_input=True, moe_router_topk=1)
    ref_out, ref_grads = _run(megatron, (4, 0, 2, 6, 1, 0, 3, 2))
    out, grads = _run(ours, (4, 0, 2, 6, 1, 0, 3, 2))
    _assert_close(out, ref_out, "output")
    for name in grads:
        _assert_close(grads[name], ref_grads[name], name)


def test_grouped_experts_bf16_follow_megatron():
    megatron, ours = _experts_pair(torch.bfloat16)
    ref_out, _ = _run(megatron, (5, 0, 9, 1, 3, 7, 2, 4), torch.bfloat16)
    out, _ = _run(ours, (5, 0, 9, 1, 3, 7, 2, 4), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out)  # bf16 tolerances


def test_grouped_experts_reject_what_they_do_not_compute():
    with pytest.raises(ValueError, match="add_bias_linear.*grouped_experts=False"):
        _experts_pair(add_bias_linear=True)


# ------------------------------------------------------------------ whole model, checkpoints
def _model_pair(parallel, seq=16):
    from megatron_composer.models import build_model

    megatron = build_model(TINY, parallel, seq_length=seq, grouped_experts=False)
    ours = build_model(TINY, parallel, seq_length=seq)
    ours.load_state_dict(megatron.state_dict())
    return megatron, ours


def test_checkpoint_names_are_megatron_s():
    from megatron.core.transformer.moe.experts import SequentialMLP

    megatron, ours = _model_pair(_setup())
    def shapes(model):  # megatron's `_extra_state` entries are None
        return {k: getattr(v, "shape", v) for k, v in model.state_dict().items()}

    assert shapes(ours) == shapes(megatron)
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in ours.state_dict()
    assert ours.sharded_state_dict().keys() == megatron.sharded_state_dict().keys()
    assert {type(m) for m in ours.modules() if isinstance(m, SequentialMLP)} == {GroupedSequentialMLP}
    assert {type(m) for m in megatron.modules() if isinstance(m, SequentialMLP)} == {SequentialMLP}


def _model_forward_backward(model, tokens):
    from megatron_composer.models import composer_forward

    counts = []
    hooks = [m.register_forward_pre_hook(lambda _, args: counts.append(torch.as_tensor(args[1]).clone()))
             for m in model.modules() if isinstance(m, GroupedSequentialMLP)]
    logits, mtp = composer_forward(model, tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
    for h in hooks:
        h.remove()
    (logits.logsumexp(-1).mean() + mtp[0].logsumexp(-1).mean()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}, counts


def _model_body(rank, world):
    parallel = _setup(ep=world)
    megatron, ours = _model_pair(parallel)
    # few tokens per rank, so some local experts receive none
    tokens = torch.randint(0, TINY.vocab_size, (1, 6), generator=torch.Generator().manual_seed(rank))
    ref_logits, ref_grads, _ = _model_forward_backward(megatron, tokens)
    logits, grads, counts = _model_forward_backward(ours, tokens)
    _assert_close(logits, ref_logits, "logits")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _assert_close(grads[name], ref_grads[name], name)
    return [c.tolist() for c in counts]


@pytest.mark.parametrize("ep", [1, 2])
def test_model_with_grouped_experts_equals_megatron_s(ep):
    counts = _model_body(0, 1) if ep == 1 else sum(run_distributed(_model_body, ep), [])
    assert len(counts) == ep * (TINY.num_moe_layers + TINY.mtp_num_layers)
    assert all(len(c) == TINY.num_experts // ep for c in counts)
    assert any(0 in c for c in counts)  # the zero-token case was exercised


# ------------------------------------------------------------------ packed expert weights
def _weights(experts):
    return ([e.linear_fc1.weight for e in experts.local_experts], [e.linear_fc2.weight for e in experts.local_experts])


def _forward_allocations(experts, counts, shapes):
    """Shapes among `shapes` that some aten op of the experts' forward returns."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    seen = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.extend(tuple(t.shape) for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and tuple(t.shape) in shapes and func.overloadpacket
                        is not torch.ops.aten.as_strided)
            return out

    x = torch.randn(sum(counts), TINY.hidden_size)
    with Outputs():
        experts(x, torch.tensor(counts), torch.rand(sum(counts)))
    return seen


def test_expert_weights_are_read_in_place_not_stacked():
    """Each linear's expert weights are rows of one [E, out, in] tensor; the forward
    materializes no [E, out, in] copy (megatron's per-expert names stay)."""
    _, ours = _experts_pair()
    w1, w2 = _weights(ours)
    shapes = {(TINY.num_experts, *w1[0].shape), (TINY.num_experts, *w2[0].shape)}
    assert _forward_allocations(ours, [5, 0, 9, 1, 3, 7, 2, 4], shapes) == []
    assert "local_experts.7.linear_fc2.weight" in dict(ours.named_parameters())
    from megatron_composer.moe import packed_view

    for weights in (w1, w2):
        stacked = packed_view(weights)
        assert stacked is not None and stacked.data_ptr() == weights[0].data_ptr()
        assert torch.equal(stacked, torch.stack([w.detach() for w in weights]))


def test_packed_and_stacked_weights_give_identical_results():
    """Bit for bit: reading the packed rows in place equals stacking copies (the path
    taken when something has moved the parameters' storage)."""
    from megatron_composer.moe import packed_view

    _, ours = _experts_pair()
    counts = (5, 0, 9, 1, 3, 7, 2, 4)
    packed_out, packed_grads = _run(ours, counts)
    for weights in _weights(ours):
        for w in weights:
            w.data = w.data.clone()  # own storages: no longer rows of one tensor
        assert packed_view(weights) is None
    stacked_out, stacked_grads = _run(ours, counts)
    assert torch.equal(packed_out, stacked_out)
    for name in packed_grads:
        assert torch.equal(packed_grads[name], stacked_grads[name]), name


def test_checkpoint_with_per_expert_keys_loads_into_packed_weights():
    """A state dict under megatron's per-expert keys (what checkpoints hold) loads into the
    packed weights in place, and the experts then compute what megatron's do."""
    from megatron_composer.moe import packed_view

    megatron, ours = _experts_pair()
    with torch.no_grad():
        for p in megatron.parameters():
            p.normal_()
    saved = megatron.state_dict()
    assert "local_experts.3.linear_fc1.weight" in saved and saved.keys() == ours.state_dict().keys()
    ptrs = [w[0].data_ptr() for w in _weights(ours)]
    ours.load_state_dict(saved)
    assert [w[0].data_ptr() for w in _weights(ours)] == ptrs
    assert all(packed_view(w) is not None for w in _weights(ours))
    for name, value in ours.state_dict().items():
        assert value is saved[name] is None or torch.equal(value, saved[name]), name
    ref_out, _ = _run(megatron, (4, 0, 2, 6, 1, 0, 3, 2))
    out, _ = _run(ours, (4, 0, 2, 6, 1, 0, 3, 2))
    _assert_close(out, ref_out, "output")


def test_dtype_conversion_keeps_the_weights_packed():
    from megatron_composer.moe import packed_view

    _, ours = _experts_pair()
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    ours.to(torch.bfloat16)
    assert all(packed_view(w) is not None for w in _weights(ours))
    for name, p in ours.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[name].to(torch.bfloat16)), name


# ------------------------------------------------------------------ fused SwiGLU
def _fused_pair(dtype=torch.float32):
    """(megatron SequentialMLP, ours), both with bias_activation_fusion, same weights."""
    from megatron_composer.moe import GroupedSequentialMLP as Grouped

    megatron, ours = _experts_pair(dtype, bias_activation_fusion=True)
    assert type(ours) is Grouped and ours.config.bias_activation_fusion
    return megatron, ours


def test_fused_swiglu_experts_equal_megatron_s_fused_experts():
    """With bias_activation_fusion both run megatron's weighted SwiGLU; on CPU it runs eagerly."""
    megatron, ours = _fused_pair()
    counts = (5, 0, 9, 1, 3, 7, 2, 4)
    ref_out, ref_grads = _run(megatron, counts)
    out, grads = _run(ours, counts)
    _assert_close(out, ref_out, "output")
    for name in grads:
        _assert_close(grads[name], ref_grads[name], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_equals_the_unfused_activation(dtype):
    """The fused weighted SwiGLU against our unfused path on the same weights: the forward is
    the same ops in the same order (bitwise), and so are the probs' and fc2's gradients; the
    gradients through the SiLU use megatron's closed-form derivative, with its products in
    another order: equal to rounding (relative norm 1e-6 in fp32, 1e-2 in bf16, whose
    epsilon is 7.8e-3)."""
    _, fused = _fused_pair(dtype)
    _, plain = _experts_pair(dtype)
    plain.load_state_dict(fused.state_dict())
    counts = (5, 0, 9, 1, 3, 7, 2, 4)
    out, grads = _run(fused, counts, dtype)
    ref_out, ref_grads = _run(plain, counts, dtype)
    assert torch.equal(out, ref_out)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name in grads:
        if name == "probs" or name.endswith("linear_fc2.weight"):
            assert torch.equal(grads[name], ref_grads[name]), name
        else:
            err = (grads[name].double() - ref_grads[name].double()).norm()
            assert err <= tol * ref_grads[name].double().norm(), (name, float(err))


def test_fused_swiglu_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="activation_func_clamp_value.*7.0.*bias_activation_fusion off"):
        _experts_pair(bias_activation_fusion=True, activation_func_clamp_value=7.0)
