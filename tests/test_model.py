"""Model: parameter counts, build + forward/backward, EP=2 == EP=1, core attention."""
import math

import pytest
import torch

from megatron_composer.attention.core import causal_attention, packed_causal_attention
from megatron_composer.config import count_parameters, get_preset
from tests.distributed import run_distributed

TINY = get_preset("tiny")


def test_published_parameter_counts():
    kimi = count_parameters(get_preset("kimi-k2.5"))
    assert abs(kimi.total / 1.04e12 - 1) < 0.03 and abs(kimi.active / 32e9 - 1) < 0.03
    ds = count_parameters(get_preset("deepseek-v3"))
    assert abs(ds.total / 671e9 - 1) < 0.03 and abs(ds.active / 37e9 - 1) < 0.03


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt5'.*tiny"):
        get_preset("gpt5")


def _build(cfg, ep=1, seq=32):
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    layout = ParallelLayout(world_size=env.world_size, ep=ep)
    initialize_parallel(layout, seed=1234)
    return build_model(cfg, layout, seq_length=seq)


def _inputs(seq=32, batch=2, vocab=TINY.vocab_size):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    return tokens, torch.arange(seq).expand(batch, seq)


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(first_k_dense_layers=TINY.num_layers)], ids=["moe", "dense"])
def test_count_matches_the_built_model(cfg):
    """Total, active and MTP counts equal the built model's parameters (+ the expert-bias
    buffers the published counts include); with no MoE layer the MTP layer is dense too."""
    model = _build(cfg)
    params = dict(model.named_parameters())
    main = sum(p.numel() for n, p in params.items() if not n.startswith("mtp."))
    mtp = sum(p.numel() for n, p in params.items() if n.startswith("mtp."))
    routed = sum(p.numel() for n, p in params.items() if ".local_experts." in n and not n.startswith("mtp."))
    bias = dict(model.named_buffers())
    main += sum(b.numel() for n, b in bias.items() if n.endswith("expert_bias") and not n.startswith("mtp."))
    mtp += sum(b.numel() for n, b in bias.items() if n.endswith("expert_bias") and n.startswith("mtp."))
    count = count_parameters(cfg)
    assert main == count.total
    assert mtp == count.mtp
    assert count.active == main - routed + routed * cfg.moe_router_topk // cfg.num_experts
    assert (routed == 0) == (cfg.num_moe_layers == 0)


def _hand_count(c) -> tuple[int, int, int]:
    """DeepSeek-V3's closed form (total, active, MTP), written out per layer kind."""
    h, heads, qk = c.hidden_size, c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
    q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk if c.q_lora_rank else h * heads * qk
    kv = h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank + c.kv_lora_rank * heads * (
        c.qk_head_dim + c.v_head_dim)
    attention = q + kv + heads * c.v_head_dim * h + 2 * h

    def moe(experts):
        return (experts * 3 * h * c.moe_ffn_hidden_size + 3 * h * c.moe_shared_expert_intermediate_size
                + c.num_experts * h + (c.num_experts if c.moe_router_enable_expert_bias else 0))

    dense = c.first_k_dense_layers * (attention + 3 * h * c.ffn_hidden_size)
    embeddings = c.vocab_size * h * (2 if c.untie_embeddings_and_output_weights else 1) + h
    total = dense + c.num_moe_layers * (attention + moe(c.num_experts)) + embeddings
    active = dense + c.num_moe_layers * (attention + moe(c.moe_router_topk)) + embeddings
    mtp = c.mtp_num_layers * (2 * h + 2 * h * h + attention + moe(c.num_experts) + h)
    return total, active, mtp


def test_count_equals_the_closed_form_for_every_preset():
    from megatron_composer.config import PRESETS

    for name, cfg in PRESETS.items():
        count = count_parameters(cfg)
        assert (count.total, count.active, count.mtp) == _hand_count(cfg), name


def test_forward_backward_world1():
    from megatron_composer.models import composer_forward

    model = _build(TINY)
    tokens, pos = _inputs()
    logits, mtp = composer_forward(model, tokens, pos)
    assert logits.shape == (2, 32, TINY.vocab_size) and len(mtp) == TINY.mtp_num_layers
    (logits.logsumexp(-1).mean() + mtp[0].logsumexp(-1).mean()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["mtp.layers.0.eh_proj.weight"].abs().sum() > 0
    assert grads["decoder.layers.0.self_attention.linear_kv_up_proj.weight"].abs().sum() > 0


def _ep_body(rank, world, state_path, ep):
    from megatron_composer.models import composer_forward
    from megatron_composer.checkpoint import load_model_state_dict, global_param_names

    model = _build(TINY, ep=ep)
    load_model_state_dict(model, torch.load(state_path))
    tokens, pos = _inputs()
    logits, mtp = composer_forward(model, tokens, pos)
    (logits.logsumexp(-1).mean() + mtp[0].logsumexp(-1).mean()).backward()
    names = global_param_names(model)
    return logits.detach(), {names[n]: p.grad for n, p in model.named_parameters()}


def test_expert_parallel_2_equals_1(tmp_path):
    from megatron_composer.models import composer_forward
    from megatron_composer.checkpoint import model_state_dict

    model = _build(TINY)
    state = model_state_dict(model)
    # a nonzero expert bias, so routing with the bias is compared too
    for k in state:
        if k.endswith("expert_bias"):
            state[k].copy_(torch.linspace(-0.01, 0.01, state[k].numel()))
    torch.save(state, tmp_path / "state.pt")
    from megatron_composer.checkpoint import load_model_state_dict

    load_model_state_dict(model, state)
    tokens, pos = _inputs()
    logits, mtp = composer_forward(model, tokens, pos)
    (logits.logsumexp(-1).mean() + mtp[0].logsumexp(-1).mean()).backward()
    from megatron_composer.checkpoint import global_param_names

    names = global_param_names(model)
    ref = {names[n]: p.grad for n, p in model.named_parameters()}
    results = run_distributed(_ep_body, 2, str(tmp_path / "state.pt"), 2)
    seen = set()
    for out_logits, grads in results:
        torch.testing.assert_close(out_logits, logits, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            # Both ranks run the same batch; an expert serves the tokens of
            # every rank in its EP group, so its gradient is the sum of both.
            expected = ref[name] * (2 if ".experts." in name and "shared" not in name else 1)
            torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(ref)  # every parameter, every expert, compared once or more


def test_causal_attention_matches_explicit_softmax():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 5, 6, generator=g), torch.randn(1, 2, 7, 6, generator=g)
    v = torch.randn(1, 2, 7, 3, generator=g)
    out = causal_attention(q, k, v, softmax_scale=0.5)
    scores = (q @ k.transpose(-1, -2)) * 0.5
    qpos = torch.arange(5)[:, None] + 2
    scores = scores.masked_fill(torch.arange(7)[None, :] > qpos, -math.inf)
    torch.testing.assert_close(out, scores.softmax(-1) @ v)


def test_packed_attention_equals_separate_documents():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(9, 2, 4, generator=g), torch.randn(9, 2, 4, generator=g), torch.randn(9, 2, 3, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, 0.5)
    for s, e in ((0, 4), (4, 9)):
        ref = causal_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), 0.5)[0].transpose(0, 1)
        torch.testing.assert_close(out[s:e], ref)
