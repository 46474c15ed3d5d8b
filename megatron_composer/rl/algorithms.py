"""The RL algorithm as pure functions of tensors: advantages, KL estimators, the policy loss.

The recipe is Dr.GRPO: a fixed group of samples per prompt, advantage =
reward minus the group mean (no division by the group std), and per-token
terms summed over the whole step and divided by one constant, never by a
sample's own length (GRPO's 1/|o| term makes a long wrong answer cheaper per
token than a short one). `grpo` and `rloo` are here to compare against.

Registries, one entry per estimator, each a pure function with its formula:

    ADVANTAGE_ESTIMATORS   dr_grpo, grpo, rloo    ([G, n] rewards -> [G, n] advantages)
    KL_ESTIMATORS          k1, k2, k3             (per-token logp, ref_logp -> per-token KL)
    policy_losses.POLICY_LOSSES  dr_grpo, ppo_clip, decoupled_ppo  (per-token log-probs -> loss)

KL placement (`--kl-placement reward|loss`, `--kl-coef`). With log r =
ref_logp - logp on tokens sampled from the policy pi:

- "reward" (the default the loop uses, with k1): the caller subtracts
  kl_coef * sum_t k1_t from each sample's reward before advantages
  (`kl_penalized_rewards`). The policy gradient then carries the score
  function of the sequence KL, an unbiased gradient of
  kl_coef * KL(pi || pi_ref) with k1's low variance.
- "loss": `policy_gradient_loss(..., ref_logp=, kl_coef=, kl_kind=)` adds
  kl_coef * k_t per token. Differentiated through logp, k2 gives the exact
  on-policy gradient of KL(pi || pi_ref) (grad k2 = -log r * grad logp,
  whose expectation under pi is grad KL); k1's gradient is grad logp, whose
  expectation under pi is zero, so k1 in the loss only regularizes through
  sampling noise; k3 is biased and its variance grows quickly once pi and
  pi_ref diverge (the reason the recipe prefers k1).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .policy_losses import PolicyLossConfig, get_policy_loss, masked_mean


def _require_group_size(rewards: Tensor, minimum: int, kind: str) -> None:
    if rewards.shape[1] < minimum:
        raise ValueError(
            f"advantage kind {kind!r} needs group_size >= {minimum}, got rewards of shape "
            f"{tuple(rewards.shape)}; sample at least {minimum} completions per prompt or use kind='dr_grpo'")


def dr_grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr.GRPO: A_ij = r_ij - mean_j(r_ij). `eps` is unused (no division).

    rewards: [num_groups, group_size] float. Returns the same shape.
    """
    return rewards - rewards.mean(dim=1, keepdim=True)


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps), std unbiased (divides by n - 1).

    rewards: [num_groups, group_size >= 2] float. Returns the same shape.
    """
    _require_group_size(rewards, 2, "grpo")
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + eps)


def rloo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """RLOO: A_ij = r_ij - (sum_k r_ik - r_ij) / (n - 1), the mean of the group's other samples.

    Equals n / (n - 1) * (r_ij - mean_j r_ij). `eps` is unused.
    rewards: [num_groups, group_size >= 2] float. Returns the same shape.
    """
    _require_group_size(rewards, 2, "rloo")
    n = rewards.shape[1]
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "dr_grpo": dr_grpo_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
}


def group_advantages(rewards: Tensor, kind: str = "dr_grpo", eps: float = 1e-6) -> Tensor:
    """Advantages of `rewards` [num_groups, group_size], one row per prompt, by `kind`.

    kind: a key of ADVANTAGE_ESTIMATORS (see each function for its formula).
    Integer rewards are promoted to the default float dtype. Returns [num_groups, group_size].
    """
    if kind not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage kind {kind!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}; "
            "for a flat list of n = G * group_size rewards ordered by prompt, pass rewards.view(G, group_size)")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return ADVANTAGE_ESTIMATORS[kind](rewards, eps)


def k1(log_ratio: Tensor) -> Tensor:
    """k1 = -log r, with log r = log pi_ref(token) - log pi(token). Unbiased for KL(pi || pi_ref)."""
    return -log_ratio


def k2(log_ratio: Tensor) -> Tensor:
    """k2 = (log r)^2 / 2. Biased, non-negative, low variance."""
    return 0.5 * log_ratio.square()


def k3(log_ratio: Tensor) -> Tensor:
    """k3 = r - 1 - log r = expm1(log r) - log r. Unbiased and non-negative; variance grows as exp(log r)."""
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    logp, ref_logp: same shape (e.g. [T] packed tokens), log pi and log pi_ref
    of each sampled token. log r = ref_logp - logp; kind a key of KL_ESTIMATORS
    (k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r).
    Returns the same shape; gradients flow into both inputs.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp shape {tuple(logp.shape)} != ref_logp shape {tuple(ref_logp.shape)}; "
                         "both hold one log-prob per sampled token")
    return KL_ESTIMATORS[kind](ref_logp - logp)


def kl_penalized_rewards(rewards: Tensor, kl_per_token_sums: Tensor, kl_coef: float) -> Tensor:
    """KL in the reward ("reward" placement): r'_i = r_i - kl_coef * sum_t k1_it.

    rewards, kl_per_token_sums: same shape (one value per sample, e.g. [G, n]);
    kl_per_token_sums[i] = sum over sample i's generated tokens of kl_estimate(..., "k1").
    """
    if rewards.shape != kl_per_token_sums.shape:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} != kl_per_token_sums shape "
                         f"{tuple(kl_per_token_sums.shape)}; pass one KL sum per sample")
    return rewards - kl_coef * kl_per_token_sums


def default_normalizer(num_samples: int, max_new_tokens: int) -> float:
    """The loss normalizer the loop uses: num_samples * max_new_tokens, one constant per update.

    Dr.GRPO's reference divides each sample's token sum by the generation budget
    and averages over the samples: the same constant. A constant (not the number
    of generated tokens) keeps every token's weight independent of how long the
    other samples in the step happen to be.
    """
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"num_samples {num_samples} and max_new_tokens {max_new_tokens} must both be >= 1")
    return float(num_samples * max_new_tokens)


def policy_gradient_loss(
    logp: Tensor,
    old_logp: Optional[Tensor],
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    normalizer: float,
    clip_eps_low: Optional[float] = None,
    clip_eps_high: Optional[float] = None,
    sampler_logp: Optional[Tensor] = None,
    tis_cap: Optional[float] = None,
    entropy: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k1",
    policy_loss: Optional[str] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of one micro-batch: a registered policy loss, plus the KL term and the metrics.

        loss = sum_t m_t (l_t + kl_coef * kl_estimate(logp_t, ref_logp_t, kl_kind)) / normalizer

    l_t is `policy_losses.get_policy_loss(policy_loss)` (each loss documents its
    formula); policy_loss None picks "ppo_clip" when clip_eps_low is set and
    "dr_grpo" otherwise. The sum runs over every masked-in token and is divided
    by one constant, `normalizer` (the loop passes default_normalizer(num_samples,
    max_new_tokens)), never by a sample's own length, so every token of every
    sample weighs 1 / normalizer; micro-batches and data-parallel ranks add up
    (pass normalizer / dp_size where the data-parallel reduction averages).

    logp:         [T] float, log pi_theta of each sampled token (differentiable); any shape works
                  as long as the other per-token tensors match it.
    old_logp:     [T] detached or None, log-probs of the policy before this step's updates
                  (None: logp detached, for the losses that allow it).
    advantages:   [T] or broadcastable (a per-sample advantage repeated over its tokens by the caller).
    loss_mask:    [T] bool (or 0/1), 1 on generated tokens, 0 on prompt, tool output and padding;
                  masked-out positions may hold any finite or infinite log-probs.
    clip_eps_low / clip_eps_high: the clip range of ppo_clip / decoupled_ppo (PolicyLossConfig's
                  default when clip_eps_low is None); clip_eps_high defaults to clip_eps_low.
    sampler_logp: [T], log-probs under the policy that sampled the tokens.
    tis_cap:      the cap of the importance weight against the sampler (None: no TIS).
    entropy:      [T], each token's entropy of the policy's next-token distribution, only for the
                  "entropy" metric (`training.losses.token_log_probs(..., entropy=True)` computes it
                  with the log-probs, without [T, V] fp32 temporaries).
    ref_logp:     [T], log pi_ref; enables the "kl" metric, and the KL loss term when kl_coef != 0.

    Returns (loss, metrics). metrics are detached 0-d tensors, means over masked-in tokens:
    the policy loss's ("ratio_mean", "clip_fraction", "tis_weight_mean" where a weight applies),
    "loss" (the total), "entropy" (when entropy is given), "kl" (with ref_logp).
    """
    if clip_eps_high is not None and clip_eps_low is None:
        raise ValueError(f"clip_eps_high={clip_eps_high} given without clip_eps_low; pass clip_eps_low too")
    if kl_coef and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp (log-probs of the reference model); "
                         "pass ref_logp or set kl_coef=0.0")
    name = policy_loss or ("ppo_clip" if clip_eps_low is not None else "dr_grpo")
    clip = {} if clip_eps_low is None else {"clip_eps_low": clip_eps_low, "clip_eps_high": clip_eps_high}
    config = PolicyLossConfig(tis_cap=tis_cap, **clip)
    loss, metrics = get_policy_loss(name)(logp, old_logp, sampler_logp, advantages, loss_mask, normalizer, config)
    keep = loss_mask.bool()
    mask = keep.to(logp.dtype)
    if ref_logp is not None:
        kl = kl_estimate(torch.where(keep, logp, 0.0), torch.where(keep, ref_logp, 0.0), kl_kind)
        if kl_coef:
            loss = loss + kl_coef * torch.where(keep, kl, 0.0).sum() / normalizer
        metrics["kl"] = masked_mean(kl.detach(), mask)
    metrics["loss"] = loss.detach()
    if entropy is not None:
        if entropy.shape != logp.shape:
            raise ValueError(f"entropy shape {tuple(entropy.shape)} != logp shape {tuple(logp.shape)}; "
                             "pass one entropy per token")
        metrics["entropy"] = masked_mean(entropy.detach().float(), mask.float())
    return loss, metrics
