"""Activation recompute (--recompute-*): megatron-core recomputes, nothing changes.

Recompute re-runs the same forward ops in backward, so on CPU the loss and
every gradient must equal the run that stores activations, bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_composer.config import get_preset
from megatron_composer.config.training import RecomputeConfig

TINY = get_preset("tiny")
SEQ = 32


def _build(recompute: RecomputeConfig):
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    layout = ParallelLayout(world_size=env.world_size)
    initialize_parallel(layout, seed=1234)
    return build_model(TINY, layout, seq_length=SEQ, recompute=recompute)


def _loss_and_grads(model, packed: bool):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_composer.models import composer_forward

    g = torch.Generator().manual_seed(0)
    batch = 1 if packed else 2
    tokens = torch.randint(0, TINY.vocab_size, (batch, SEQ), generator=g)
    params = None
    if packed:
        cu = torch.tensor([0, 12, 20, SEQ], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=12, max_seqlen_kv=12)
    model.train()
    model.zero_grad()
    logits, mtp = composer_forward(model, tokens, torch.arange(SEQ).expand(batch, SEQ), params)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss = loss + 0.1 * F.cross_entropy(mtp[0][:, :-2].flatten(0, 1), tokens[:, 2:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def reference():
    model = _build(RecomputeConfig())
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    return state, {packed: _loss_and_grads(model, packed) for packed in (False, True)}


@pytest.mark.parametrize("recompute", [
    RecomputeConfig("full", "uniform", 1),
    RecomputeConfig("full", "block", 1),
    RecomputeConfig("selective", recompute_modules=("core_attn",)),
    RecomputeConfig("selective", recompute_modules=("mla_up_proj",)),
    RecomputeConfig("selective", recompute_modules=("core_attn", "mla_up_proj", "mlp", "moe", "shared_experts")),
], ids=["full-uniform", "full-block", "core_attn", "mla_up_proj", "five-modules"])
def test_recompute_gives_the_same_loss_and_gradients(reference, recompute):
    state, expected = reference
    model = _build(recompute)
    assert model.config.recompute_granularity == recompute.recompute_granularity
    model.load_state_dict(state)
    for packed in (False, True):
        loss, grads = _loss_and_grads(model, packed)
        ref_loss, ref_grads = expected[packed]
        assert torch.equal(loss, ref_loss), (packed, loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (packed, name)


def test_recompute_actually_recomputes():
    """A full-recompute layer runs its forward twice per step (otherwise the test above proves nothing)."""
    model = _build(RecomputeConfig("full", "uniform", 1))
    calls = []
    model.decoder.layers[0].register_forward_hook(lambda *_: calls.append(1))
    _loss_and_grads(model, packed=False)
    assert len(calls) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(recompute_granularity="full"), r"full needs --recompute-method uniform\|block and --recompute-num-layers"),
    (dict(recompute_granularity="selective", recompute_method="block"), r"apply to --recompute-granularity full"),
    (dict(recompute_modules=("core_attn",)), r"--recompute-modules core_attn needs --recompute-granularity selective"),
    (dict(recompute_granularity="selective", recompute_modules=("attn",)), r"--recompute-modules attn: use some of"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0), r"must be >= 1"),
    (dict(recompute_granularity="half"), r"--recompute-granularity 'half'"),
])
def test_recompute_config_errors_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecomputeConfig(**kwargs)


def test_recompute_num_layers_beyond_the_model():
    with pytest.raises(ValueError, match=r"--recompute-num-layers 9 is more than the model's 3 layers; use 1..3"):
        RecomputeConfig("full", "block", 9).check_layers(3)


@pytest.mark.parametrize("modules, expert_precision, match", [
    (("layernorm",), "bf16", r"layernorm needs --transformer-impl transformer_engine"),
    (("moe_act",), "bf16", r"moe_act needs TE's grouped experts"),
])
def test_recompute_modules_that_need_te_are_refused_with_local(modules, expert_precision, match):
    from megatron_composer.config.training import TransformerImplConfig
    from megatron_composer.models.te_spec import check_te_choices

    with pytest.raises(ValueError, match=match):
        check_te_choices(TransformerImplConfig("local"), RecomputeConfig("selective", recompute_modules=modules),
                         expert_precision)


def test_mtp_uniform_recompute_needs_one_layer_per_chunk():
    with pytest.raises(ValueError, match=r"--recompute-num-layers 2 with MTP.*needs --recompute-num-layers 1"):
        _build(RecomputeConfig("full", "uniform", 2))
