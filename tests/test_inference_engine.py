"""The inference engine against full recomputation, transformers and megatron-core's RouterReplay.

References: `composer_forward` over the whole sequence (the training
forward), transformers' `DeepseekV3ForCausalLM.generate()` on a converted
checkpoint, megatron-core's `RouterReplay` in record mode during a training
forward, and the closed-form marginal of the target distribution for
speculative sampling.
"""
import math

import pytest
import torch

from megatron_composer.config import get_preset
from megatron_composer.inference import SamplingParams
from megatron_composer.inference.engine import Engine
from megatron_composer.inference.sampling import sampling_logprobs, speculative_accept, token_logprobs
from tests.test_convert import make_hf, needs_transformers, save_hf

# Small enough for a fast suite, with every feature the engine touches:
# q LoRA, a dense layer then MoE with a shared expert and group-limited routing, MTP.
SMALL = get_preset("tiny").replace(num_layers=3, hidden_size=64, vocab_size=512, ffn_hidden_size=128,
                                   moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                                   max_position_embeddings=512, init_method_std=0.05)
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)


def build(cfg=SMALL, seed=1234, **overrides):
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    layout = ParallelLayout(world_size=env.world_size)
    initialize_parallel(layout, seed=seed)
    return build_model(cfg, layout, seq_length=cfg.max_position_embeddings, **overrides).eval()


@pytest.fixture(scope="module")
def model():
    return build()


def prompts(lengths=(5, 29, 13), vocab=SMALL.vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def full_logprobs(model, tokens):
    """Temperature-1 log-probs [len - 1, vocab] of every next token, recomputed over the whole sequence."""
    from megatron_composer.models import composer_forward

    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits, _ = composer_forward(model, ids, torch.arange(ids.shape[1])[None])
    return torch.log_softmax(logits[0].float(), dim=-1)[:-1]


def test_kv_cache_decode_equals_full_recomputation(model):
    engine = Engine(model, SMALL, max_model_len=128)
    for prompt, out in zip(prompts(), engine.generate(prompts(), GREEDY)):
        ref = full_logprobs(model, prompt + out.token_ids)[len(prompt) - 1:]
        assert out.token_ids == ref.argmax(-1).tolist()
        got = torch.tensor(out.logprobs)
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        top = torch.tensor([[lp for _, lp in row] for row in out.top_logprobs])
        torch.testing.assert_close(top, ref.topk(3, dim=-1).values, rtol=0, atol=1e-5)
        assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
        assert out.sampling_logprobs == [0.0] * GREEDY.max_tokens  # greedy: a point mass


def test_dispatch_free_moe_equals_megatron_moe_layer(model):
    from megatron_composer.inference.runner import ModelRunner

    runner = ModelRunner(model, 1, 16)
    layers = [layer for layer in runner.layers if runner._mlp[layer] == runner._moe]
    assert layers, "the test model's MoE layers should take the dispatcher-free path"
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tokens in (1, 2, 17):
            x = torch.randn(tokens, 1, SMALL.hidden_size, generator=g)
            for layer in layers:
                assert torch.equal(runner._moe(layer.mlp, x)[0], layer.mlp(x)[0])


def test_batched_equals_unbatched_and_chunked_prefill_equals_whole(model):
    batch = Engine(model, SMALL, max_model_len=128).generate(prompts(), GREEDY)
    chunked = Engine(model, SMALL, max_model_len=128, prefill_chunk_size=4).generate(prompts(), GREEDY)
    for i, prompt in enumerate(prompts()):
        alone = Engine(model, SMALL, max_model_len=128).generate([prompt], GREEDY)[0]
        for other in (batch[i], chunked[i]):
            assert other.token_ids == alone.token_ids
            torch.testing.assert_close(torch.tensor(other.logprobs), torch.tensor(alone.logprobs),
                                       rtol=0, atol=1e-5)


def test_requests_join_and_leave_between_steps(model):
    engine = Engine(model, SMALL, max_model_len=128, max_batch_size=2)
    alone = [Engine(model, SMALL, max_model_len=128).generate([p], GREEDY)[0].token_ids for p in prompts()]
    first = engine.add_request(prompts()[0], SamplingParams(max_tokens=4, temperature=0))
    for _ in range(2):
        engine.step()
    second = engine.add_request(prompts()[1], GREEDY)  # joins a running batch
    third = engine.add_request(prompts()[2], GREEDY)  # waits for the first one's slot
    engine.step()
    assert len(engine._running) == 2 and not third.done()
    while engine.has_unfinished():
        engine.step()
    assert first.result().token_ids == alone[0][:4]
    assert second.result().token_ids == alone[1] and third.result().token_ids == alone[2]


def test_seeded_sampling_is_reproducible_whatever_the_batch(model):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=7, logprobs=True)
    engine = Engine(model, SMALL, max_model_len=128, seed=1)
    a = engine.generate(prompts(), params)
    b = engine.generate(prompts()[::-1], params)[::-1]
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    other = engine.generate(prompts(), SamplingParams(max_tokens=10, temperature=0.9, seed=8))
    assert [x.token_ids for x in other] != [x.token_ids for x in a]
    for prompt, out in zip(prompts(), a):  # sampling log-probs are those of the filtered distribution
        ref = full_logprobs(model, prompt + out.token_ids)[len(prompt) - 1:]
        q = sampling_logprobs(ref * 1.0, 0.9, 40, 0.95)
        want = q.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.sampling_logprobs), want, rtol=0, atol=1e-4)


def test_logprobs_are_those_of_the_sampling_temperature(model):
    """A sampled token's `logprobs` entry is log_softmax(logits / T) of a full forward (no top-k: the
    trainer scores over the full vocabulary); `sampling_logprobs` also apply the top-k filter."""
    from megatron_composer.models import composer_forward

    params = SamplingParams(max_tokens=8, temperature=0.5, top_k=40, seed=3, logprobs=True, top_logprobs=2)
    engine = Engine(model, SMALL, max_model_len=128)
    for prompt, out in zip(prompts(), engine.generate(prompts(), params)):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits, _ = composer_forward(model, ids, torch.arange(ids.shape[1])[None])
        rows = logits[0, len(prompt) - 1:-1].double()
        sampled = torch.tensor(out.token_ids)
        scaled = rows / 0.5
        want = scaled.gather(1, sampled[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-4)
        temperature_one = torch.log_softmax(rows, -1).gather(1, sampled[:, None]).squeeze(1)
        assert (torch.tensor(out.logprobs, dtype=torch.float64) - temperature_one).abs().max() > 1e-2
        torch.testing.assert_close(token_logprobs(rows, sampled, 0.5), want.float(), rtol=0, atol=1e-4)
        top = torch.tensor([[lp for _, lp in row] for row in out.top_logprobs], dtype=torch.float64)
        torch.testing.assert_close(top, torch.log_softmax(scaled, -1).topk(2, dim=-1).values, rtol=0, atol=1e-4)
        kept = sampling_logprobs(rows.float(), 0.5, 40).gather(1, sampled[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.sampling_logprobs), kept, rtol=0, atol=1e-4)


def test_token_logprobs_by_hand():
    # logits (ln 1, ln 2, ln 5) at T = 1: p = 1/8, 2/8, 5/8; at T = 0.5 the logits double: 1, 4, 25 over 30
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0], [1.0, 2.0, 5.0]], dtype=torch.float64)).requires_grad_()
    labels = torch.tensor([2, 0])
    got = token_logprobs(logits, labels, 0.5)
    torch.testing.assert_close(got, torch.tensor([math.log(25 / 30), math.log(1 / 30)]), rtol=0, atol=1e-6)
    torch.testing.assert_close(token_logprobs(logits, labels, 0.0), token_logprobs(logits, labels, 1.0))
    torch.testing.assert_close(token_logprobs(logits, labels, 1.0)[0], torch.tensor(math.log(5 / 8)),
                               rtol=0, atol=1e-6)
    got[0].backward()  # d/dz_v log softmax(z / T)_2 = (1[v = 2] - q_v) / T with q = (1, 4, 25) / 30
    torch.testing.assert_close(logits.grad[0], torch.tensor([-1 / 30, -4 / 30, 5 / 30], dtype=torch.float64) * 2,
                               rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="temperature=-1"):
        token_logprobs(logits, labels, -1)


def test_stop_token_and_max_model_len(model):
    engine = Engine(model, SMALL, max_model_len=40)
    first = engine.generate([prompts()[0]], GREEDY)[0]
    stop = first.token_ids[3]
    out = engine.generate([prompts()[0]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == first.token_ids[:first.token_ids.index(stop) + 1] and out.finish_reason == "stop"
    long = engine.generate([prompts((35,))[0]], SamplingParams(max_tokens=100, temperature=0))[0]
    assert len(long.token_ids) == 40 - 35 and long.finish_reason == "length"


@pytest.mark.parametrize("bad, match", [([], "empty"), ([0, SMALL.vocab_size], "outside the vocabulary"),
                                        ([1] * 128, "max_model_len"), ("hello", "list of token ids")])
def test_bad_prompts_are_named(model, bad, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, SMALL, max_model_len=128).add_request(bad, GREEDY)


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                          ("top_k", -2), ("speculative", "eagle"), ("top_logprobs", 50)])
def test_bad_sampling_params_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_routed_experts_equal_router_replay_records_of_a_training_forward():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_composer.models import composer_forward

    RouterReplay.clear_global_router_replay_instances()
    model = build(moe_enable_routing_replay=True)
    try:
        engine = Engine(model, SMALL, max_model_len=128)
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, return_routed_experts=True)
        outs = engine.generate(prompts(), params)
        for prompt, out in zip(prompts(), outs):
            tokens = prompt + out.token_ids
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            with torch.no_grad():
                composer_forward(model, torch.tensor([tokens]), torch.arange(len(tokens))[None])
            RouterReplay.clear_global_router_replay_action()
            # decoder routers first (the MTP layer's router is built after them)
            decoder = RouterReplay.get_recorded_data()[:SMALL.num_moe_layers]
            recorded = torch.stack(decoder, dim=1)  # [tokens, moe layers, topk]
            got = out.routed_experts
            assert got.dtype == torch.int32
            assert got.shape == (len(tokens), SMALL.num_moe_layers, SMALL.moe_router_topk)
            assert torch.equal(got[:-1].long(), recorded[:-1].long())
            assert (got[-1] == -1).all()  # the last token was never fed
    finally:
        RouterReplay.clear_global_router_replay_instances()


def test_greedy_speculative_equals_plain_greedy(model, monkeypatch):
    engine = Engine(model, SMALL, max_model_len=128)
    plain = engine.generate(prompts(), GREEDY)
    spec = engine.generate(prompts(), SamplingParams(max_tokens=12, temperature=0, logprobs=True,
                                                     speculative="mtp"))
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
        assert b.speculative.proposed == b.speculative.steps > 0
    # An oracle MTP that drafts the right token every other step exercises acceptance.
    from megatron_composer.inference import speculative

    truth = {tuple(p): p + a.token_ids for p, a in zip(prompts(), plain)}
    real_draft = speculative.MTPDrafter.draft

    def oracle(self, reqs, generator_of):
        real_draft(self, reqs, generator_of)
        for req in reqs:
            full = truth[tuple(req.prompt)]
            if req.num_computed % 2 == 0 and req.num_computed + 1 < len(full):
                req.drafter_state.draft = [full[req.num_computed + 1]]

    monkeypatch.setattr(speculative.MTPDrafter, "draft", oracle)
    spec = engine.generate(prompts(), SamplingParams(max_tokens=12, temperature=0, speculative="mtp"))
    assert [s.token_ids for s in spec] == [a.token_ids for a in plain]
    assert sum(s.speculative.accepted for s in spec) >= 6
    assert all(s.speculative.steps < 12 for s in spec)  # accepted drafts save verification steps


def test_mtp_draft_distribution_is_the_mtp_head(model):
    """The drafter's MTP forward over the cache equals the training forward's MTP head."""
    from megatron_composer.inference.runner import ModelRunner, Segment
    from megatron_composer.models import composer_forward

    tokens = prompts((20,))[0]
    with torch.no_grad():
        _, (mtp,) = composer_forward(model, torch.tensor([tokens]), torch.arange(20)[None])
        runner = ModelRunner(model, 2, 64)
        hidden, _ = runner.trunk(torch.tensor(tokens), torch.arange(20), [Segment(1, 0, 20)])
        out = [runner.mtp(0, hidden[:8], torch.tensor(tokens[1:9]), torch.arange(8), [Segment(1, 0, 8)])]
        for p in range(8, 19):  # then one position at a time, as decoding does
            out.append(runner.mtp(0, hidden[p:p + 1], torch.tensor(tokens[p + 1:p + 2]), torch.tensor([p]),
                                  [Segment(1, p, 1)]))
        got = runner.logits(torch.cat(out))
    torch.testing.assert_close(got, mtp[0, :19].float(), rtol=0, atol=1e-5)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 0.001
CRITICAL = {7: 24.32, 15: 37.70}


def test_speculative_acceptance_rule_preserves_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(8, generator=g) * 1.5, 0)
    q = torch.log_softmax(torch.randn(8, generator=g) * 1.5, 0)
    counts, naive = torch.zeros(8), torch.zeros(8)
    for _ in range(20000):
        draft = int(torch.multinomial(q.exp(), 1, generator=g))
        accepted, residual = speculative_accept(p, q, draft, float(torch.rand((), generator=g)))
        token = draft if accepted else int(torch.multinomial(residual.exp(), 1, generator=g))
        counts[token] += 1
        naive[draft] += 1  # always accepting emits q, not p: the test must tell them apart
    assert _chi_square(counts, p.exp()) < CRITICAL[7]
    assert _chi_square(naive, p.exp()) > 10 * CRITICAL[7]


def test_speculative_sampling_in_the_engine_matches_the_target_distribution():
    """The second token of a completion is the first one that goes through draft + verify; its
    marginal over many seeds must be sum_t1 p(t1) p(t2 | t1), computed by full forwards."""
    cfg = SMALL.replace(vocab_size=16)
    model = build(cfg, seed=5)
    prompt = [3, 1, 4, 1, 5]
    first = full_logprobs(model, prompt + [0])[-1].exp()  # p(t1 | prompt)
    second = torch.stack([full_logprobs(model, prompt + [t, 0])[-1].exp() for t in range(16)])
    marginal = first @ second  # p(t2) = sum_t1 p(t1) p(t2 | t1)
    engine = Engine(model, cfg, max_batch_size=64, max_model_len=16)
    n = 3000
    handles = [engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=s,
                                                         speculative="mtp")) for s in range(n)]
    while engine.has_unfinished():
        engine.step()
    outs = [h.result() for h in handles]
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=16).float()
    assert sum(o.speculative.proposed for o in outs) == n
    assert 0 < sum(o.speculative.accepted for o in outs) < n  # both branches ran
    assert _chi_square(counts, marginal) < CRITICAL[15]
    assert _chi_square(counts, first) > CRITICAL[15]  # the test has power: p(t1) differs


def test_weight_update_mid_generation_changes_later_tokens_only(model, tmp_path):
    from megatron_composer.checkpoint import model_state_dict

    other = build(seed=99)
    new_state = {k: v.clone() for k, v in model_state_dict(other).items()}
    engine = Engine(build(), SMALL, max_model_len=128)
    old_state = {k: v.clone() for k, v in model_state_dict(engine.model).items()}
    prompt = prompts()[1]
    params = SamplingParams(max_tokens=12, temperature=0)
    before = engine.generate([prompt], params)[0]
    handle = engine.add_request(prompt, params)
    while len(engine._running[0].generated) < 5 if engine._running else True:
        engine.step()
    assert engine.update_weights(new_state, version=7) == 7
    while not handle.done():
        engine.step()
    out = handle.result()
    assert out.token_ids[:5] == before.token_ids[:5]
    assert out.policy_versions == [0] * 5 + [7] * 7
    assert out.token_ids[5:] != before.token_ids[5:]

    # A bad source changes nothing; a delta and a checkpoint path land the same weights.
    name = next(k for k in new_state if k.endswith("linear_kv_up_proj.weight"))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({name: torch.zeros(3)})
    with pytest.raises(ValueError, match="NaN"):
        engine.update_weights({name: torch.full_like(new_state[name], math.nan)})
    with pytest.raises(ValueError, match="not a tensor of this model"):
        engine.update_weights({"decoder.nope": torch.zeros(1)})
    assert engine.version == 7
    engine.update_weights(old_state, version=8)
    assert engine.generate([prompt], params)[0].token_ids == before.token_ids
    flat = new_state[name].reshape(-1)
    changed = torch.arange(0, flat.numel(), 3)
    engine.update_weights({name: {"indices": changed, "values": flat[changed]}})
    assert engine.version == 9
    assert torch.equal(model_state_dict(engine.model)[name].reshape(-1)[changed], flat[changed])
    assert torch.equal(model_state_dict(engine.model)[name].reshape(-1)[1::3], old_state[name].reshape(-1)[1::3])


@needs_transformers
def test_greedy_generate_matches_transformers_on_a_converted_checkpoint(tmp_path):
    from megatron_composer.convert import hf_to_mcore

    hf, mtp = make_hf(seed=3, rope_scaling=None, num_nextn_predict_layers=1)
    save_hf(hf, mtp, tmp_path / "hf")
    hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "mc"), progress=False)
    engine = Engine.from_checkpoint(str(tmp_path / "mc"), max_model_len=64)
    vocab = hf.config.vocab_size
    batch = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 12)]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=True)
    for prompt, ours in zip(batch, engine.generate(batch, params)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
        tokens = ref.sequences[0, len(prompt):].tolist()
        assert ours.token_ids == tokens
        want = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(ref.scores, tokens)])
        torch.testing.assert_close(torch.tensor(ours.logprobs), want, rtol=0, atol=1e-4)
    spec = engine.generate(batch, SamplingParams(max_tokens=16, temperature=0, speculative="mtp"))
    assert [s.token_ids for s in spec] == [o.token_ids for o in engine.generate(batch, params)]
