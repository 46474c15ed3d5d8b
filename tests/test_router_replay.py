"""Router replay with the plausibility filter: the rule by hand, and the training forward's routing."""
import pytest
import torch

from megatron_composer.inference import SamplingParams
from megatron_composer.inference.engine import Engine
from megatron_composer.moe.replay import RouterReplayController, filter_replayed_experts
from tests.test_inference_engine import SMALL, build, prompts


def test_filter_replaces_exactly_the_implausible_experts():
    gates = torch.tensor([[0.9, 0.8, 0.1, 0.05, 0.5],
                          [0.2, 0.3, 0.6, 0.7, 0.1],
                          [0.5, 0.4, 0.3, 0.2, 0.1]])
    own = torch.tensor([[0, 1], [3, 2], [0, 1]])  # the router's top-2, best first
    replayed = torch.tensor([[2, 1],   # gate 0.1 < 0.5 * 0.8: replaced by 0 (the best own expert not replayed)
                             [4, 0],   # both below 0.5 * 0.6 = 0.3: replaced by 3, then 2
                             [-1, -1]])  # never recorded: the router's own choice
    chosen, replaced = filter_replayed_experts(gates, own, replayed, threshold=0.5)
    assert chosen.tolist() == [[0, 1], [3, 2], [0, 1]]
    assert replaced.tolist() == [[True, False], [True, True], [False, False]]
    # 0.3 is not below 0.5 * 0.6: plausible, kept although the router would not pick it
    chosen, replaced = filter_replayed_experts(gates, own, torch.tensor([[4, 0], [1, 3], [0, 1]]), 0.5)
    assert chosen.tolist() == [[4, 0], [1, 3], [0, 1]] and not replaced.any()
    chosen, _ = filter_replayed_experts(gates, own, replayed.clamp_min(0), threshold=0.0)
    assert chosen.tolist() == [[2, 1], [4, 0], [0, 0]]  # threshold 0 replays everything
    with pytest.raises(ValueError, match="threshold"):
        filter_replayed_experts(gates, own, replayed, threshold=1.5)


def test_training_forward_routes_by_the_engine_records():
    from megatron_composer.models import composer_forward

    engine = Engine(build(), SMALL, max_model_len=128)
    outs = engine.generate(prompts(), SamplingParams(max_tokens=6, temperature=1.0, seed=0,
                                                     return_routed_experts=True))
    trainer_model = build(seed=4321)  # other weights: its own routing would differ
    controller = RouterReplayController(trainer_model, threshold=0.0)
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        controller.set(out.routed_experts)
        with torch.no_grad():
            composer_forward(trainer_model, torch.tensor([tokens]), torch.arange(len(tokens))[None])
        used = torch.stack([r.recorded_topk_idx for r in controller.replays], dim=1)
        assert torch.equal(used[:-1], out.routed_experts[:-1].long())
        controller.clear()
    # With the filter on, some of the other model's experts are implausible under this router.
    controller = RouterReplayController(trainer_model, threshold=1.0)
    controller.set(outs[1].routed_experts)
    tokens = outs[1].prompt_token_ids + outs[1].token_ids
    with torch.no_grad():
        composer_forward(trainer_model, torch.tensor([tokens]), torch.arange(len(tokens))[None])
    assert 0 < controller.replaced_fraction() < 1
