"""The policy-loss registry against hand-computed losses and gradients (float64, a few tokens)."""
import math

import pytest
import torch

from megatron_composer.rl.policy_losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    check_rl_sampling,
    decoupled_ppo,
    dr_grpo,
    get_policy_loss,
    ppo_clip,
    register_policy_loss,
)

LN2 = math.log(2)


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), rtol=tol, atol=tol)


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def run(loss_fn, logp, old, sampler, adv, mask, normalizer, **config):
    """(loss, d loss / d logp, metrics) of one call."""
    logp.grad = None
    loss, metrics = loss_fn(logp, old, sampler, adv, mask, normalizer, PolicyLossConfig(**config))
    loss.backward()
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    return loss, logp.grad.clone(), metrics


# Five trained tokens and a padding token. rho = exp(logp - old) = 2, 0.5, 1, 0.5, 1.1.
RHO = [2.0, 0.5, 1.0, 0.5, 1.1]
ADV = f64([1.0, 1.0, -2.0, -1.0, 1.0, 7.0])
MASK = torch.tensor([1, 1, 1, 1, 1, 0])
OLD = f64([-1.0, -2.0, -0.5, -1.5, -0.7, 0.0])
N = 4.0


def logp_for(ratios=RHO):
    return leaf([o + math.log(r) for o, r in zip(OLD.tolist(), ratios)] + [-9.0])


def test_the_registry_holds_the_three_losses_and_refuses_a_duplicate_name():
    assert {"dr_grpo", "ppo_clip", "decoupled_ppo"} <= set(POLICY_LOSSES)
    assert get_policy_loss("dr_grpo") is dr_grpo and get_policy_loss("decoupled_ppo") is decoupled_ppo
    with pytest.raises(ValueError, match="policy loss 'ppo_clip' is already registered"):
        register_policy_loss("ppo_clip")(lambda *a: None)
    assert POLICY_LOSSES["ppo_clip"] is ppo_clip
    try:
        register_policy_loss("test_only_loss")(dr_grpo)
        assert get_policy_loss("test_only_loss") is dr_grpo
    finally:
        del POLICY_LOSSES["test_only_loss"]


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown policy loss 'grpo_clip'; choose one of "
                                         r"decoupled_ppo, dr_grpo, ppo_clip"):
        get_policy_loss("grpo_clip")


def test_dr_grpo_is_the_unclipped_loss():
    logp = logp_for()
    loss, grad, metrics = run(dr_grpo, logp, OLD, None, ADV, MASK, N)
    # l_t = -rho_t A_t: -(2 + 0.5 - 2 - 0.5 + 1.1) / 4; d l_t / d logp_t = -rho_t A_t
    close(loss, -1.1 / 4)
    close(grad, [-2 / 4, -0.5 / 4, 2 / 4, 0.5 / 4, -1.1 / 4, 0.0])
    close(metrics["ratio_mean"], 5.1 / 5)
    close(metrics["clip_fraction"], 0.0)
    assert set(metrics) == {"loss", "ratio_mean", "clip_fraction"}


def test_dr_grpo_without_old_logp_is_reinforce_at_ratio_one():
    logp = logp_for()
    loss, grad, metrics = run(dr_grpo, logp, None, None, ADV, MASK, N)
    close(loss, -(1 + 1 - 2 - 1 + 1) / 4)  # sum of A over the trained tokens, / N
    close(grad, [-1 / 4, -1 / 4, 2 / 4, 1 / 4, -1 / 4, 0.0])
    close(metrics["ratio_mean"], 1.0)


def test_dr_grpo_truncated_importance_weight():
    logp = logp_for()
    # old - sampler = ln 3, ln 0.5, 0, ln 2, 0 -> w = min(., 1.5) = 1.5, 0.5, 1, 1.5, 1
    sampler = OLD - f64([math.log(3), math.log(0.5), 0.0, LN2, 0.0, 0.0])
    loss, grad, metrics = run(dr_grpo, logp, OLD, sampler, ADV, MASK, N, tis_cap=1.5)
    w = [1.5, 0.5, 1.0, 1.5, 1.0]
    terms = [-wi * r * a for wi, r, a in zip(w, RHO, ADV.tolist())]  # -3, -0.25, 2, 0.75, -1.1
    close(loss, sum(terms) / 4)
    close(grad, [t / 4 for t in terms] + [0.0])  # w is detached: d l / d logp = l
    close(metrics["tis_weight_mean"], sum(w) / 5)
    # tis_cap None: no weight even with the sampler given
    loss, _, metrics = run(dr_grpo, logp, OLD, sampler, ADV, MASK, N)
    close(loss, -1.1 / 4)
    assert "tis_weight_mean" not in metrics


def test_ppo_clip_by_hand_with_clip_higher():
    logp = logp_for()
    loss, grad, metrics = run(ppo_clip, logp, OLD, None, ADV, MASK, N, clip_eps_low=0.2, clip_eps_high=0.28)
    # min(rho A, clip(rho, 0.8, 1.28) A):
    #   (2, +1) -> 1.28 clipped   (0.5, +1) -> 0.5   (1, -2) -> -2   (0.5, -1) -> -0.8 clipped   (1.1, +1) -> 1.1
    close(loss, -(1.28 + 0.5 - 2 - 0.8 + 1.1) / 4)
    close(grad, [0.0, -0.5 / 4, 2 / 4, 0.0, -1.1 / 4, 0.0])  # clipped tokens carry no gradient
    close(metrics["clip_fraction"], 2 / 5)
    close(metrics["ratio_mean"], 5.1 / 5)
    # the metrics follow the batch: at ratio 1 nothing clips
    _, _, metrics = run(ppo_clip, logp_for([1.0] * 5), OLD, None, ADV, MASK, N)
    close(metrics["clip_fraction"], 0.0)
    close(metrics["ratio_mean"], 1.0)


def test_a_tiny_clip_changes_the_gradient_and_a_huge_one_is_the_unclipped_loss():
    logp = logp_for()
    unclipped_loss, unclipped_grad, _ = run(dr_grpo, logp, OLD, None, ADV, MASK, N)
    tiny_loss, tiny_grad, metrics = run(ppo_clip, logp, OLD, None, ADV, MASK, N, clip_eps_low=1e-3)
    # every ratio but the third is outside [0.999, 1.001]; tokens 0, 3 and 4 take the clipped branch
    close(tiny_grad, [0.0, -0.5 / 4, 2 / 4, 0.0, 0.0, 0.0])
    close(tiny_loss, -(1.001 + 0.5 - 2 - 0.999 + 1.001) / 4)
    close(metrics["clip_fraction"], 3 / 5)
    assert not torch.allclose(tiny_grad, unclipped_grad)
    huge_loss, huge_grad, metrics = run(ppo_clip, logp, OLD, None, ADV, MASK, N, clip_eps_low=1e9)
    close(huge_loss, unclipped_loss)
    close(huge_grad, unclipped_grad)
    close(metrics["clip_fraction"], 0.0)


def test_ppo_clip_needs_a_real_old_policy():
    logp = logp_for()
    with pytest.raises(ValueError, match=r"old_logp is None.*--ppo-mini-batches > 1.*decoupled_ppo"):
        ppo_clip(logp, None, None, ADV, MASK, N, PolicyLossConfig())


def test_ppo_clip_with_tis_multiplies_the_clipped_term():
    logp = leaf([math.log(1.5), math.log(1.1)])
    old = f64([0.0, 0.0])
    sampler = f64([math.log(0.5), 0.0])  # w = min(2, 3) = 2, 1
    loss, grad, metrics = run(ppo_clip, logp, old, sampler, f64([1.0, 1.0]), torch.ones(2), 1.0, tis_cap=3.0)
    close(loss, -(2 * 1.2 + 1 * 1.1))
    close(grad, [0.0, -1.1])
    close(metrics["tis_weight_mean"], 1.5)


# decoupled: r = pi_theta / pi_prox = 1.5, 1, 0.5; w = pi_prox / mu = 4, 0.5, 2; A = 1, -1, -1
PROX = f64([-1.0, -2.0, -0.5])
DEC_ADV = f64([1.0, -1.0, -1.0])
SAMPLER = PROX - f64([math.log(4), math.log(0.5), LN2])


def test_decoupled_ppo_weighs_by_the_behaviour_policy_and_caps_it():
    logp = leaf([p + math.log(r) for p, r in zip(PROX.tolist(), [1.5, 1.0, 0.5])])
    ones = torch.ones(3)
    loss, grad, metrics = run(decoupled_ppo, logp, PROX, SAMPLER, DEC_ADV, ones, 2.0)
    # min(r A, clip(r, 0.8, 1.2) A) = 1.2 (clipped), -1, -0.8 (clipped); l = -w * that = -4.8, 0.5, 1.6
    close(loss, (-4.8 + 0.5 + 1.6) / 2)
    close(grad, [0.0, 0.5 / 2, 0.0])  # d l / d logp = -w r A on the unclipped token
    close(metrics["tis_weight_mean"], (4 + 0.5 + 2) / 3)
    close(metrics["clip_fraction"], 2 / 3)
    close(metrics["ratio_mean"], 1.0)
    # tis_cap 3: w = 3, 0.5, 2
    loss, grad, metrics = run(decoupled_ppo, logp, PROX, SAMPLER, DEC_ADV, ones, 2.0, tis_cap=3.0)
    close(loss, (-3 * 1.2 + 0.5 + 1.6) / 2)
    close(metrics["tis_weight_mean"], (3 + 0.5 + 2) / 3)
    # without the behaviour weight (ppo_clip against the same proximal policy) the loss differs
    plain, _, _ = run(ppo_clip, logp, PROX, None, DEC_ADV, ones, 2.0)
    close(plain, (-1.2 + 1 + 0.8) / 2)


def test_decoupled_ppo_without_prox_uses_the_current_weights():
    logp = leaf([-1.0, -1.0])
    sampler = f64([-1.0 - LN2, -1.0 + math.log(4)])  # w = pi_theta / mu = 2, 0.25
    adv = f64([1.0, 1.0])
    loss, grad, metrics = run(decoupled_ppo, logp, None, sampler, adv, torch.ones(2), 1.0)
    close(loss, -(2 + 0.25))
    close(grad, [-2.0, -0.25])
    close(metrics["ratio_mean"], 1.0)
    close(metrics["clip_fraction"], 0.0)
    # = dr_grpo with TIS against the current weights (the cap above every weight)
    same, same_grad, _ = run(dr_grpo, logp, None, sampler, adv, torch.ones(2), 1.0, tis_cap=10.0)
    close(same, loss)
    close(same_grad, grad)
    with pytest.raises(ValueError, match="decoupled_ppo weighs every token by pi_prox / mu"):
        decoupled_ppo(logp, None, None, adv, torch.ones(2), 1.0, PolicyLossConfig())


@pytest.mark.parametrize("name", ["dr_grpo", "ppo_clip", "decoupled_ppo"])
def test_masked_out_positions_cannot_poison_any_loss(name):
    logp = leaf([-1.0, -1.0, float("-inf")])
    old = f64([-1.0, -1.0, 0.0])
    sampler = f64([-1.0, -1.0, float("nan")])
    loss, grad, metrics = run(get_policy_loss(name), logp, old, sampler, f64([1.0, 1.0, 5.0]),
                              torch.tensor([1, 1, 0]), 2.0, tis_cap=2.0)
    close(loss, -1.0)
    close(grad, [-0.5, -0.5, 0.0])
    assert all(torch.isfinite(v) for v in metrics.values())


def _minibatch_grads(clip_eps):
    """Two SGD updates of a one-row softmax policy over one step's tokens, split into two mini-batches,
    with the old log-probs computed once before the first update. Returns each update's gradient."""
    theta = torch.tensor([0.3, -0.2, 0.1, 0.0], dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([0, 1, 2, 0, 3, 1])
    adv = f64([1.0, -1.0, 0.5, 1.0, -0.5, -1.0])
    with torch.no_grad():
        old = torch.log_softmax(theta, -1)[tokens]
    grads = []
    for part in (slice(0, 3), slice(3, 6)):
        logp = torch.log_softmax(theta, -1)[tokens[part]]
        if clip_eps is None:
            loss, _ = dr_grpo(logp, old[part], None, adv[part], torch.ones(3), 6.0, PolicyLossConfig())
        else:
            loss, _ = ppo_clip(logp, old[part], None, adv[part], torch.ones(3), 6.0,
                               PolicyLossConfig(clip_eps_low=clip_eps))
        theta.grad = None
        loss.backward()
        grads.append(theta.grad.clone())
        with torch.no_grad():
            theta -= 5.0 * theta.grad
    return grads


def test_a_clip_of_1e_3_changes_the_gradient_of_the_second_mini_batch():
    unclipped, tiny, huge = _minibatch_grads(None), _minibatch_grads(1e-3), _minibatch_grads(1e9)
    close(tiny[0], unclipped[0])  # the first update is at ratio 1: nothing to clip
    assert not torch.allclose(tiny[1], unclipped[1], atol=1e-6)
    close(huge[1], unclipped[1])


def test_policy_loss_config_errors_name_the_value():
    with pytest.raises(ValueError, match="clip_eps_low -0.1 must be a finite number >= 0"):
        PolicyLossConfig(clip_eps_low=-0.1)
    with pytest.raises(ValueError, match="tis_cap 0 must be a finite number > 0"):
        PolicyLossConfig(tis_cap=0)
    assert PolicyLossConfig(clip_eps_low=0.2).clip_range == (0.8, 1.2)
    assert PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28).clip_range == (0.8, 1.28)
    with pytest.raises(ValueError, match=r"sampler_logp shape \(2,\) != logp shape \(3,\)"):
        dr_grpo(torch.zeros(3), None, torch.zeros(2), torch.zeros(3), torch.ones(3), 1.0, PolicyLossConfig())
    with pytest.raises(ValueError, match="normalizer 0 must be a positive finite number"):
        dr_grpo(torch.zeros(3), None, None, torch.zeros(3), torch.ones(3), 0, PolicyLossConfig())


def test_rl_sampling_refuses_a_truncated_distribution_unless_the_backend_returns_its_logprobs():
    check_rl_sampling(0.7, 1.0, 0)
    check_rl_sampling(1.0, 0.9, 40, backend_returns_truncated=True)
    for top_p, top_k, named in ((0.9, 0, "--top-p 0.9"), (1.0, 40, "--top-k 40"),
                                (0.9, 40, "--top-p 0.9 and --top-k 40")):
        with pytest.raises(ValueError, match=rf"{named} samples from a truncated distribution.*full vocabulary"
                                             r".*silently biased.*--top-p 1 --top-k 0"):
            check_rl_sampling(1.0, top_p, top_k)
    for bad, match in (((0.0, 1.0, 0), "--temperature 0.0"), ((1.0, 0.0, 0), "--top-p 0.0"),
                       ((1.0, 1.0, -1), "--top-k -1")):
        with pytest.raises(ValueError, match=match):
            check_rl_sampling(*bad)
