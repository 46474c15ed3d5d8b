"""The policy losses: one registry of pure functions of per-token tensors.

Every loss has the same signature and the same reduction (verl's
`@register_policy_loss` is the model):

    fn(logp, old_logp, sampler_logp, advantages, loss_mask, normalizer, config) -> (loss, metrics)
    loss = sum over masked-in tokens t of l_t / normalizer

with one constant `normalizer` for the whole step (never a sample's own
length; `algorithms.default_normalizer`), so micro-batches and ranks add up.

Three log-probs of each sampled token can enter:

    logp          log pi_theta, the policy being trained (differentiable)
    old_logp      log pi_old, the policy before this step's first optimizer update
                  (computed once by the trainer when a step makes several updates)
    sampler_logp  log mu, the policy that sampled the token (the rollout engine's
                  weights; older than pi_old in async RL, and never bit-equal to it)

Registered (`get_policy_loss(name)`):

    dr_grpo        l_t = -w_t A_t rho_t, no clipping (the default; one update per step)
    ppo_clip       l_t = -w_t min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    decoupled_ppo  AReaL's decoupled PPO: the clip against the proximal policy, the
                   off-policy correction w_t = pi_prox / mu outside it

Sampler log-probs are only comparable with the trainer's when both are the
same distribution: the same temperature (`inference.sampling.token_logprobs`
on both sides) and the full vocabulary (`check_rl_sampling`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
from torch import Tensor

from .registry import Registry

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register  # decorator: `@register_policy_loss("name")`
get_policy_loss = POLICY_LOSSES.get_entry  # the registered loss; ValueError listing the names otherwise


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The constants of the policy losses.

    clip_eps_low, clip_eps_high: the clip range [1 - eps_low, 1 + eps_high] of
        ppo_clip and decoupled_ppo (DAPO's clip-higher when eps_high > eps_low);
        eps_high None: eps_low. dr_grpo does not clip.
    tis_cap: the cap C of the importance weight min(pi / mu, C) against the
        sampler; None: no weight for dr_grpo and ppo_clip, an uncapped one for
        decoupled_ppo (whose objective needs it).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: Optional[float] = None
    tis_cap: Optional[float] = None

    def __post_init__(self):
        for name in ("clip_eps_low", "clip_eps_high"):
            eps = getattr(self, name)
            if eps is not None and not (isinstance(eps, (int, float)) and 0 <= eps < math.inf):
                raise ValueError(f"{name} {eps!r} must be a finite number >= 0 (e.g. 0.2)")
        if self.clip_eps_low is None:
            raise ValueError("clip_eps_low is None; give a number (e.g. 0.2); dr_grpo ignores it")
        if self.tis_cap is not None and not (isinstance(self.tis_cap, (int, float)) and 0 < self.tis_cap < math.inf):
            raise ValueError(f"tis_cap {self.tis_cap!r} must be a finite number > 0 (e.g. 2.0), or None")

    @property
    def clip_range(self) -> tuple[float, float]:
        high = self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high
        return 1.0 - self.clip_eps_low, 1.0 + high


# ---- shared pieces -----------------------------------------------------------------------------

def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """sum over mask != 0 of values / max(count, 1); 0 when nothing is masked in. Masked-out NaNs are ignored."""
    keep = mask.bool()
    return torch.where(keep, values, 0.0).sum() / keep.sum().clamp(min=1).to(values.dtype)


def check_policy_loss_inputs(logp: Tensor, old_logp: Optional[Tensor], sampler_logp: Optional[Tensor],
                             advantages: Tensor, loss_mask: Tensor, normalizer: float) -> None:
    """ValueError naming the first per-token tensor whose shape does not fit, or a bad normalizer."""
    for name, t in (("old_logp", old_logp), ("loss_mask", loss_mask), ("sampler_logp", sampler_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}; "
                             "pass one value per token of the packed batch")
    try:
        torch.broadcast_shapes(advantages.shape, logp.shape)
    except RuntimeError:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} does not broadcast to logp shape "
                         f"{tuple(logp.shape)}; broadcast each sample's advantage over its tokens") from None
    if isinstance(normalizer, bool) or not (isinstance(normalizer, (int, float)) and 0 < normalizer < math.inf):
        raise ValueError(f"normalizer {normalizer!r} must be a positive finite number; "
                         "use default_normalizer(num_samples, max_new_tokens)")


def importance_weight(numerator_logp: Tensor, denominator_logp: Tensor, keep: Tensor,
                      cap: Optional[float]) -> Tensor:
    """w_t = min(exp(numerator_logp_t - denominator_logp_t), cap), detached; 1 on masked-out tokens.

    cap None: uncapped. Both inputs [T]; keep [T] bool.
    """
    log_w = torch.where(keep, numerator_logp.detach() - denominator_logp.detach(), 0.0)
    weight = torch.exp(log_w)
    return weight if cap is None else weight.clamp(max=cap)


def _tis_weight(old_logp: Tensor, sampler_logp: Optional[Tensor], keep: Tensor,
                config: PolicyLossConfig) -> Optional[Tensor]:
    """Truncated importance sampling: min(pi_old / mu, tis_cap), or None when tis_cap is None."""
    if config.tis_cap is None:
        return None
    if sampler_logp is None:
        raise ValueError(f"tis_cap={config.tis_cap} weighs by the sampler's log-probs but sampler_logp is "
                         "None; pass the rollout's log-probs or set tis_cap=None")
    return importance_weight(old_logp, sampler_logp, keep, config.tis_cap)


def _masked(logp: Tensor, advantages: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(keep [T] bool, advantages [T] in logp's dtype and 0 off the mask)."""
    keep = loss_mask.bool()
    return keep, torch.where(keep, advantages.to(logp.dtype).expand_as(logp), 0.0)


def _ratio(logp: Tensor, old_logp: Tensor, keep: Tensor) -> Tensor:
    # masked-out positions may hold any log-prob (even inf): neutralized before exp()
    # so that no inf * 0 reaches the sum or the gradient
    return torch.exp(torch.where(keep, logp - old_logp.detach(), 0.0))


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, config: PolicyLossConfig) -> tuple[Tensor, Tensor]:
    """(min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), [T] bool where the clipped branch is the smaller)."""
    low, high = config.clip_range
    surrogate = ratio * advantages
    clipped_surrogate = ratio.clamp(low, high) * advantages
    return torch.minimum(surrogate, clipped_surrogate), clipped_surrogate < surrogate


def _reduce(per_token: Tensor, keep: Tensor, normalizer: float, ratio: Tensor, clipped: Tensor,
            weight: Optional[Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    loss = torch.where(keep, per_token, 0.0).sum() / normalizer
    mask = keep.to(ratio.dtype)
    metrics = {"loss": loss.detach(), "ratio_mean": masked_mean(ratio.detach(), mask),
               "clip_fraction": masked_mean(clipped.to(mask.dtype), mask)}
    if weight is not None:
        metrics["tis_weight_mean"] = masked_mean(weight, mask)
    return loss, metrics


# ---- the losses --------------------------------------------------------------------------------

@register_policy_loss("dr_grpo")
def dr_grpo(logp: Tensor, old_logp: Optional[Tensor], sampler_logp: Optional[Tensor], advantages: Tensor,
            loss_mask: Tensor, normalizer: float, config: PolicyLossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr.GRPO's unclipped policy gradient with truncated importance sampling (TIS).

        l_t   = -w_t * A_t * rho_t,   rho_t = exp(logp_t - old_logp_t)
        w_t   = min(exp(old_logp_t - sampler_logp_t), tis_cap), detached; 1 when tis_cap is None
        loss  = sum_t m_t l_t / normalizer

    old_logp None stands for logp.detach(): rho = 1 and the gradient is
    -w_t A_t grad logp_t / normalizer, the REINFORCE estimator of one update
    per step. The clip constants are unused.

    Args:
        logp: [T] float, log pi_theta of each sampled token (differentiable).
        old_logp: [T] or None, log pi_old (detached).
        sampler_logp: [T] or None, log mu of the sampler; needed when tis_cap is set.
        advantages: [T] or broadcastable to it.
        loss_mask: [T] bool or 0/1, 1 on trained tokens; masked-out entries may be any value.
        normalizer: the step's constant (> 0).
        config: PolicyLossConfig (tis_cap).
    Returns:
        (loss 0-d, metrics: detached 0-d "loss", "ratio_mean", "clip_fraction" (0: no clip),
        and "tis_weight_mean" with TIS), means over masked-in tokens.
    """
    check_policy_loss_inputs(logp, old_logp, sampler_logp, advantages, loss_mask, normalizer)
    keep, adv = _masked(logp, advantages, loss_mask)
    old = logp.detach() if old_logp is None else old_logp
    ratio = _ratio(logp, old, keep)
    weight = _tis_weight(old, sampler_logp, keep, config)
    per_token = -ratio * adv if weight is None else -weight * ratio * adv
    return _reduce(per_token, keep, normalizer, ratio, torch.zeros_like(keep), weight)


@register_policy_loss("ppo_clip")
def ppo_clip(logp: Tensor, old_logp: Optional[Tensor], sampler_logp: Optional[Tensor], advantages: Tensor,
             loss_mask: Tensor, normalizer: float, config: PolicyLossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with an asymmetric range (clip-higher) and optional TIS.

        r_t   = exp(logp_t - old_logp_t)
        l_t   = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
        w_t   = min(exp(old_logp_t - sampler_logp_t), tis_cap), detached; 1 when tis_cap is None
        loss  = sum_t m_t l_t / normalizer

    The ratio is only informative against a real old policy: the trainer's
    log-probs from before the step's first optimizer update, when the step
    makes several updates (the ratio leaves 1 from the second on). A clipped
    token carries no gradient. Arguments and metrics as `dr_grpo`; old_logp
    is required and "clip_fraction" counts the tokens whose clipped branch
    is the smaller.
    """
    if old_logp is None:
        raise ValueError("ppo_clip measures the ratio against the policy before this step's updates, but "
                         "old_logp is None (with one update per step the ratio is 1 and the clip never acts); "
                         "use --ppo-mini-batches > 1 so that the trainer computes old log-probs before the "
                         "first update, or --policy-loss decoupled_ppo (the ratio against the sampler), "
                         "or dr_grpo")
    check_policy_loss_inputs(logp, old_logp, sampler_logp, advantages, loss_mask, normalizer)
    keep, adv = _masked(logp, advantages, loss_mask)
    ratio = _ratio(logp, old_logp, keep)
    surrogate, clipped = _clipped_surrogate(ratio, adv, config)
    weight = _tis_weight(old_logp, sampler_logp, keep, config)
    per_token = -surrogate if weight is None else -weight * surrogate
    return _reduce(per_token, keep, normalizer, ratio, clipped, weight)


@register_policy_loss("decoupled_ppo")
def decoupled_ppo(logp: Tensor, old_logp: Optional[Tensor], sampler_logp: Optional[Tensor], advantages: Tensor,
                  loss_mask: Tensor, normalizer: float,
                  config: PolicyLossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298) for off-policy (async) rollouts.

    Two old policies, not one: the behaviour policy mu that sampled the
    tokens (`sampler_logp`, possibly several versions behind) and the
    proximal policy pi_prox the trust region is centred on (`old_logp`,
    the trainer's weights before this step's first update):

        r_t   = exp(logp_t - prox_logp_t)
        w_t   = exp(prox_logp_t - sampler_logp_t), capped at tis_cap when set; detached
        l_t   = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
        loss  = sum_t m_t l_t / normalizer

    w_t pi_theta / pi_prox = pi_theta / mu, so the objective is importance
    sampled from mu, while the clip bounds only the step from pi_prox.

    When old_logp is None the proximal policy is the current weights:
    prox_logp = logp.detach(). That is exactly the recomputed proximal
    log-prob when the step makes one optimizer update (the weights before the
    update are the weights now), at no extra forward; r_t is then 1, the clip
    cannot act, and the loss is dr_grpo with w_t = pi_theta / mu. With
    several updates per step the trainer must pass the log-probs computed
    before the first one.

    Where this departs from AReaL: AReaL recomputes prox with a forward pass
    (or interpolates it between mu and pi_theta by policy versions,
    `prox_logp_method`), and by default drops tokens whose weight exceeds the
    cap (`behav_imp_weight_mode="token_mask"`); here a weight above the cap is
    truncated to it, as TIS does in the other losses (AReaL's "clamp" action).

    Arguments and metrics as `ppo_clip`; sampler_logp is required and
    "tis_weight_mean" is the mean behaviour weight w_t.
    """
    if sampler_logp is None:
        raise ValueError("decoupled_ppo weighs every token by pi_prox / mu and needs the sampler's log-probs; "
                         "pass sampler_logp (the rollout's per-token log-probs) or use ppo_clip / dr_grpo")
    check_policy_loss_inputs(logp, old_logp, sampler_logp, advantages, loss_mask, normalizer)
    keep, adv = _masked(logp, advantages, loss_mask)
    prox = logp.detach() if old_logp is None else old_logp
    ratio = _ratio(logp, prox, keep)
    surrogate, clipped = _clipped_surrogate(ratio, adv, config)
    weight = importance_weight(prox, sampler_logp, keep, config.tis_cap)
    return _reduce(-weight * surrogate, keep, normalizer, ratio, clipped, weight)


# ---- what the sampler may do -------------------------------------------------------------------

def check_rl_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0, *,
                      backend_returns_truncated: bool = False) -> None:
    """ValueError unless the sampler's log-probs can stand beside the trainer's.

    The trainer scores each token under the full vocabulary at the sampling
    temperature (`token_logprobs(logits, labels, temperature)`). With top-p < 1
    or top-k > 0 the tokens come from a renormalized truncated distribution,
    whose log-probs differ from the full one's on every token: the importance
    weights and ratios would carry that difference as a silent bias. Allowed
    only when the backend returns the truncated distribution's log-probs
    (and the trainer then scores under the same truncation).
    """
    if not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):
        raise ValueError(f"--temperature {temperature!r}: RL samples at a finite temperature > 0 "
                         "(greedy groups have no variance)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p!r} must be in (0, 1] (1 keeps every token)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"--top-k {top_k!r} must be an integer >= 0 (0 keeps every token)")
    truncated = [f for f, on in ((f"--top-p {top_p}", top_p < 1), (f"--top-k {top_k}", top_k > 0)) if on]
    if truncated and not backend_returns_truncated:
        raise ValueError(f"{' and '.join(truncated)} samples from a truncated distribution, but the trainer's "
                         "log-probs are over the full vocabulary: the importance weights and ratios would be "
                         "silently biased on every token; use --top-p 1 --top-k 0 in RL (lower --temperature "
                         "to sharpen sampling), or a rollout backend that returns the truncated "
                         "distribution's log-probs")
