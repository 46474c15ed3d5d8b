"""RL algorithms against hand-computed values: advantages, KL estimators, the policy loss (pure)."""
import math

import pytest
import torch

from megatron_composer.rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    default_normalizer,
    group_advantages,
    kl_estimate,
    kl_penalized_rewards,
    policy_gradient_loss,
)
from megatron_composer.training.losses import token_log_probs

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]], dtype=torch.float64)


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), rtol=tol, atol=tol)


def test_dr_grpo_subtracts_the_group_mean():
    # means 0.5 and 2.75
    close(group_advantages(REWARDS), [[0.5, -0.5, -0.5, 0.5], [-0.75, -0.75, -0.75, 2.25]])
    assert group_advantages(REWARDS, "dr_grpo").shape == REWARDS.shape


def test_grpo_divides_by_the_unbiased_std():
    # row 0: squared deviations 4 * 0.25 = 1, / (4 - 1) -> std 1/sqrt(3); 0.5 * sqrt(3) = sqrt(3)/2
    # row 1: 3 * 0.5625 + 5.0625 = 6.75, / 3 = 2.25 -> std 1.5; -0.75 / 1.5 = -0.5, 2.25 / 1.5 = 1.5
    s = math.sqrt(3) / 2
    close(group_advantages(REWARDS, "grpo", eps=0.0), [[s, -s, -s, s], [-0.5, -0.5, -0.5, 1.5]])
    # eps sits in the denominator: 0.75 / (1.5 + 0.5) = 0.375
    close(group_advantages(REWARDS, "grpo", eps=0.5)[1], [-0.375, -0.375, -0.375, 1.125])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # row 0: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3
    # row 1: 2 - (2 + 2 + 5) / 3 = -1, 5 - (2 + 2 + 2) / 3 = 3
    close(group_advantages(REWARDS, "rloo"), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-1.0, -1.0, -1.0, 3.0]])


def test_equal_rewards_give_zero_advantage_for_every_kind():
    flat = torch.full((3, 5), 0.7, dtype=torch.float64)
    for kind in ADVANTAGE_ESTIMATORS:
        close(group_advantages(flat, kind), torch.zeros(3, 5))


def test_integer_rewards_are_promoted():
    assert group_advantages(torch.tensor([[1, 0]])).tolist() == [[0.5, -0.5]]


def test_advantage_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown advantage kind 'ppo'; choose one of \['dr_grpo', 'grpo', 'rloo'\]"):
        group_advantages(REWARDS, "ppo")
    with pytest.raises(ValueError, match=r"\[num_groups, group_size\], got shape \(8,\)"):
        group_advantages(REWARDS.flatten())
    single = torch.tensor([[1.0], [0.0]])
    close(group_advantages(single), [[0.0], [0.0]])  # dr_grpo is defined for one sample
    for kind in ("grpo", "rloo"):
        with pytest.raises(ValueError, match=f"{kind!r} needs group_size >= 2"):
            group_advantages(single, kind)


def test_kl_estimators_by_hand():
    ln2 = math.log(2)
    # pi = 0.5, pi_ref = 0.25: log r = -ln 2
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    close(kl_estimate(logp, ref, "k1"), [ln2], 1e-6)
    close(kl_estimate(logp, ref, "k2"), [ln2 ** 2 / 2], 1e-6)
    close(kl_estimate(logp, ref, "k3"), [0.5 - 1 + ln2], 1e-6)
    # pi = 0.25, pi_ref = 0.5: log r = ln 2; k1 is negative on single tokens, k3 is not
    close(kl_estimate(ref, logp, "k1"), [-ln2], 1e-6)
    close(kl_estimate(ref, logp, "k2"), [ln2 ** 2 / 2], 1e-6)
    close(kl_estimate(ref, logp, "k3"), [2 - 1 - ln2], 1e-6)
    same = torch.tensor([-0.3, -2.0])
    for kind in KL_ESTIMATORS:
        close(kl_estimate(same, same, kind), [0.0, 0.0])
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]


def test_kl_errors():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; choose one of \['k1', 'k2', 'k3'\]"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match=r"logp shape \(2,\) != ref_logp shape \(3,\)"):
        kl_estimate(torch.zeros(2), torch.zeros(3))


def test_kl_in_the_reward():
    close(kl_penalized_rewards(torch.tensor([1.0, 0.0]), torch.tensor([2.0, -1.0]), 0.1), [0.8, 0.1], 1e-6)
    with pytest.raises(ValueError, match="one KL sum per sample"):
        kl_penalized_rewards(torch.zeros(2), torch.zeros(3), 0.1)


def test_default_normalizer_is_samples_times_max_new_tokens():
    assert default_normalizer(4, 512) == 2048.0
    with pytest.raises(ValueError, match="num_samples 0"):
        default_normalizer(0, 512)


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_on_policy_loss_and_gradient_without_clipping():
    # two samples packed: 3 tokens with A = 2, 1 token with A = -1, one padding token (A garbage)
    logp = _leaf([-1.0, -2.0, -0.5, -3.0, -9.0])
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0, 7.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 0])
    loss, metrics = policy_gradient_loss(logp, logp.detach(), adv, mask, normalizer=8.0)
    close(loss, -(2 + 2 + 2 - 1) / 8)
    loss.backward()
    # ratio = 1: gradient = -A * mask / normalizer
    close(logp.grad, [-2 / 8, -2 / 8, -2 / 8, 1 / 8, 0.0])
    close(metrics["ratio_mean"], 1.0)
    close(metrics["clip_fraction"], 0.0)
    assert set(metrics) == {"loss", "ratio_mean", "clip_fraction"}
    assert not any(v.requires_grad for v in metrics.values())


def test_every_token_weighs_one_over_the_normalizer_whatever_its_sample_length():
    # sample a: 3 tokens, sample b: 1 token, both with advantage 1
    logp = _leaf([-1.0, -1.0, -1.0, -1.0])
    adv = torch.ones(4, dtype=torch.float64)
    loss, _ = policy_gradient_loss(logp, logp.detach(), adv, torch.ones(4), normalizer=10.0)
    loss.backward()
    close(logp.grad, [-0.1] * 4)
    # a per-sample mean (GRPO's 1/|o|) would instead give -1/3 per token of a and -1 to b's token
    logp.grad = None
    ratio = torch.exp(logp - logp.detach())
    per_sample_mean = -(ratio[:3].mean() + ratio[3:].mean())
    per_sample_mean.backward()
    close(logp.grad, [-1 / 3, -1 / 3, -1 / 3, -1.0])


def test_off_policy_ratio_without_clipping():
    old = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    logp = _leaf([-1.0 + math.log(1.5), -1.0 + math.log(0.5)])
    loss, metrics = policy_gradient_loss(logp, old, torch.tensor([1.0, -2.0]), torch.ones(2), normalizer=2.0)
    close(loss, -(1.5 * 1 + 0.5 * -2) / 2)
    loss.backward()
    close(logp.grad, [-1.5 / 2, 0.5 * 2 / 2])  # d(-rho A)/d logp = -rho A
    close(metrics["ratio_mean"], 1.0)


RATIOS = [1.5, 1.5, 0.5, 0.5, 1.1]
ADVS = [1.0, -1.0, 1.0, -1.0, 1.0]


def test_ppo_clipping_by_hand():
    old = torch.zeros(5, dtype=torch.float64)
    logp = _leaf([math.log(r) for r in RATIOS])
    loss, metrics = policy_gradient_loss(logp, old, torch.tensor(ADVS), torch.ones(5), normalizer=4.0,
                                         clip_eps_low=0.2)
    # min(rho A, clip(rho, 0.8, 1.2) A): (1.5,+1) -> 1.2 clipped; (1.5,-1) -> -1.5; (0.5,+1) -> 0.5;
    # (0.5,-1) -> -0.8 clipped; (1.1,+1) -> 1.1
    close(loss, -(1.2 - 1.5 + 0.5 - 0.8 + 1.1) / 4)
    loss.backward()
    # clipped tokens get no gradient, the others -rho A / normalizer
    close(logp.grad, [0.0, 1.5 / 4, -0.5 / 4, 0.0, -1.1 / 4])
    close(metrics["clip_fraction"], 2 / 5)
    close(metrics["ratio_mean"], sum(RATIOS) / 5)


def test_asymmetric_clipping():
    old = torch.zeros(5, dtype=torch.float64)
    logp = _leaf([math.log(r) for r in RATIOS])
    loss, _ = policy_gradient_loss(logp, old, torch.tensor(ADVS), torch.ones(5), normalizer=1.0,
                                   clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, -(1.28 - 1.5 + 0.5 - 0.8 + 1.1), 1e-9)


def test_truncated_importance_sampling_weights():
    logp = _leaf([-1.0, -1.0, -1.0])
    # old - sampler = ln 3, ln 0.5, 0 -> w = min(3, 2) = 2, 0.5, 1
    sampler = torch.tensor([-1.0 - math.log(3), -1.0 - math.log(0.5), -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    loss, metrics = policy_gradient_loss(logp, logp.detach(), adv, torch.ones(3), normalizer=2.0,
                                         sampler_logp=sampler, tis_cap=2.0)
    close(loss, -(2 * 1 + 0.5 * 1 + 1 * -1) / 2)
    loss.backward()
    close(logp.grad, [-2 / 2, -0.5 / 2, 1 / 2])
    close(metrics["tis_weight_mean"], (2 + 0.5 + 1) / 3)


def test_tis_with_clipping_multiplies_the_clipped_term():
    old = torch.zeros(2, dtype=torch.float64)
    logp = _leaf([math.log(1.5), math.log(1.1)])
    sampler = torch.tensor([math.log(0.5), 0.0], dtype=torch.float64)  # w = min(2, 3) = 2, 1
    loss, _ = policy_gradient_loss(logp, old, torch.ones(2), torch.ones(2), normalizer=1.0,
                                   clip_eps_low=0.2, sampler_logp=sampler, tis_cap=3.0)
    close(loss, -(2 * 1.2 + 1 * 1.1))


def test_kl_in_the_loss_and_kl_metric():
    logp = _leaf([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)  # logp - ref = 0.5, -1.0
    zero = torch.zeros(2, dtype=torch.float64)
    loss, metrics = policy_gradient_loss(logp, logp.detach(), zero, torch.ones(2), normalizer=4.0,
                                         ref_logp=ref, kl_coef=0.1)
    close(loss, 0.1 * (0.5 - 1.0) / 4)
    close(metrics["kl"], (0.5 - 1.0) / 2)
    loss.backward()
    close(logp.grad, [0.1 / 4, 0.1 / 4])  # d k1 / d logp = 1
    logp.grad = None
    loss, metrics = policy_gradient_loss(logp, logp.detach(), zero, torch.ones(2), normalizer=4.0,
                                         ref_logp=ref, kl_coef=0.1, kl_kind="k2")
    close(metrics["kl"], (0.25 + 1.0) / 2 / 2)
    loss.backward()
    close(logp.grad, [0.1 * 0.5 / 4, 0.1 * -1.0 / 4])  # d k2 / d logp = logp - ref
    # with kl_coef 0 the KL is only a metric
    loss, metrics = policy_gradient_loss(logp, logp.detach(), zero, torch.ones(2), normalizer=4.0, ref_logp=ref)
    close(loss, 0.0)
    close(metrics["kl"], -0.25)


def test_entropy_metric_over_masked_tokens():
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125], [1.0, 1e-9, 1e-9, 1e-9]]))
    _, entropy = token_log_probs(logits[None], torch.zeros(1, 3, dtype=torch.long), entropy=True)
    logp = _leaf([-1.0, -1.0, -1.0])
    _, metrics = policy_gradient_loss(logp, logp.detach(), torch.ones(3), torch.tensor([1, 1, 0]),
                                      normalizer=1.0, entropy=entropy[0])
    # H = ln 4 = 2 ln 2 and 0.5 ln 2 + 0.25 ln 4 + 2 * 0.125 ln 8 = 1.75 ln 2; the third row is masked out
    close(metrics["entropy"], (2 + 1.75) / 2 * math.log(2), 1e-6)


def test_masked_out_positions_cannot_poison_the_loss():
    logp = _leaf([-1.0, -1.0, float("-inf")])
    old = torch.tensor([-1.0, -1.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, float("-inf")], dtype=torch.float64)
    sampler = torch.tensor([-1.0, -1.0, float("nan")], dtype=torch.float64)
    loss, metrics = policy_gradient_loss(logp, old, torch.ones(3), torch.tensor([1, 1, 0]), normalizer=2.0,
                                         clip_eps_low=0.2, sampler_logp=sampler, tis_cap=2.0, ref_logp=ref,
                                         kl_coef=0.5, kl_kind="k3")
    loss.backward()
    close(loss, -1.0)
    close(logp.grad, [-0.5, -0.5, 0.0])
    assert all(torch.isfinite(v) for v in metrics.values())
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [float("nan"), 0.0]])
    _, entropy = token_log_probs(logits[None], torch.zeros(1, 3, dtype=torch.long), entropy=True)
    _, metrics = policy_gradient_loss(logp, old, torch.ones(3), torch.tensor([1, 1, 0]), normalizer=2.0,
                                      entropy=entropy[0])
    assert torch.isfinite(metrics["entropy"])


def test_micro_batches_add_up_to_the_whole_batch():
    gen = torch.Generator().manual_seed(0)
    logp = _leaf((-torch.rand(10, generator=gen, dtype=torch.float64)).tolist())
    old = logp.detach() + 0.1 * torch.randn(10, generator=gen, dtype=torch.float64)
    adv = torch.randn(10, generator=gen, dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 1, 1])
    kwargs = dict(normalizer=12.0, clip_eps_low=0.1)
    whole, _ = policy_gradient_loss(logp, old, adv, mask, **kwargs)
    whole.backward()
    grad, logp.grad = logp.grad.clone(), None
    parts = [policy_gradient_loss(logp[s], old[s], adv[s], mask[s], **kwargs)[0] for s in (slice(0, 3), slice(3, 10))]
    sum(parts).backward()
    close(sum(parts), whole)
    close(logp.grad, grad)


def test_loss_errors_name_the_problem():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"old_logp shape \(2,\) != logp shape \(3,\)"):
        policy_gradient_loss(x, torch.zeros(2), x, x, normalizer=1.0)
    with pytest.raises(ValueError, match=r"advantages shape \(2,\) does not broadcast"):
        policy_gradient_loss(x, x, torch.zeros(2), x, normalizer=1.0)
    for bad in (0.0, -1.0, float("inf"), None):
        with pytest.raises(ValueError, match="normalizer .* must be a positive finite number"):
            policy_gradient_loss(x, x, x, x, normalizer=bad)
    with pytest.raises(ValueError, match="clip_eps_high=0.3 given without clip_eps_low"):
        policy_gradient_loss(x, x, x, x, normalizer=1.0, clip_eps_high=0.3)
    with pytest.raises(ValueError, match="tis_cap=2.0 weighs by the sampler's log-probs but sampler_logp is None"):
        policy_gradient_loss(x, x, x, x, normalizer=1.0, tis_cap=2.0)
    # a sampler without a cap is no TIS (dr_grpo, ppo_clip): no weight, no weight metric
    _, metrics = policy_gradient_loss(x, x, x, x, normalizer=1.0, sampler_logp=x)
    assert "tis_weight_mean" not in metrics
    with pytest.raises(ValueError, match="tis_cap -1.0 must be a finite number > 0"):
        policy_gradient_loss(x, x, x, x, normalizer=1.0, sampler_logp=x, tis_cap=-1.0)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
        policy_gradient_loss(x, x, x, x, normalizer=1.0, kl_coef=0.1)
