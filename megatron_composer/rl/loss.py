"""The policy loss as a plug-in of the shared training step (`training.loss_plugins`).

`count` is the micro-batch's share of the update's one constant normalizer
(`RLBatch.normalizer_share`), so the update's global count is that constant
and the loss is sum over every trained token / normalizer, whatever the
split into micro-batches and ranks. `loss_sum` recomputes log pi(x_{t+1})
from the logits at the sampling temperature (log_softmax(z / T), the
distribution the sampler drew from) and hands it to the policy loss.

The log-probs and the entropy metric come from one pass over the logits in
chunks of positions (`training.losses.token_log_probs`): fp32 lives one chunk
at a time, and backward writes d loss / d logits into the logits' own storage
(`overwrite_logits`, as the LM loss does; `training.loss_plugins.ModelOutput`).
Everything after that (ratios, clipping, TIS, the KL to the reference) is
per-token [T] math on the log-probs.

old_logp: the log-probs the trainer computed under the weights before the
step's first update (`RLBatch.old_logp`, with `--ppo-mini-batches N > 1`);
without them it is logp detached (ratio 1: one update on fresh rollouts),
and the sampler's log-probs enter through truncated importance sampling.
Per-token diagnostics are kept for the step's log.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..inference.sampling import logprob_temperature
from ..training.losses import token_log_probs
from .algorithms import policy_gradient_loss
from .config import RLConfig


@dataclass
class PolicyLoss:
    cfg: RLConfig
    name: str = "policy loss"
    scale: float = 1.0
    stats: dict = field(default_factory=dict)

    @property
    def needs_old_logp(self) -> bool:
        """Whether the loss needs the step's old log-probs computed by a forward (with one update the old
        log-probs are the update's own, detached, and every registered loss accepts that)."""
        return False

    def count(self, batch, shift):
        return torch.tensor(float(batch.normalizer_share), device=batch.tokens.device)

    def loss_sum(self, batch, out, shift):
        cfg = self.cfg
        logp, entropy = token_log_probs(out.logits, batch.labels, logprob_temperature(cfg.rollout.temperature),
                                        entropy=True, overwrite_logits=True)
        logp, entropy, mask = logp[0], entropy[0], batch.loss_mask[0]
        kl_in_loss = cfg.algorithm.kl_coef if cfg.algorithm.kl_placement == "loss" else 0.0
        ref = batch.ref_logp[0] if batch.ref_logp is not None else None
        use_tis = cfg.algorithm.tis_cap is not None
        old_logp = batch.old_logp[0] if getattr(batch, "old_logp", None) is not None else logp.detach()
        loss, metrics = policy_gradient_loss(
            logp, old_logp, batch.advantages[0], mask, normalizer=1.0,
            clip_eps_low=cfg.algorithm.clip_eps_low, clip_eps_high=cfg.algorithm.clip_eps_high,
            sampler_logp=batch.sampler_logp[0] if use_tis else None, tis_cap=cfg.algorithm.tis_cap if use_tis else None,
            entropy=entropy, ref_logp=ref, kl_coef=kl_in_loss, kl_kind=cfg.algorithm.kl_kind,
            policy_loss=cfg.algorithm.policy_loss)
        keep = mask.bool()
        tokens = float(keep.sum())
        gap = (logp.detach() - batch.sampler_logp[0])[keep].abs()
        self._add("tokens", tokens)
        self._add("mismatch", gap.tolist(), concat=True)
        for key in ("entropy", "kl", "ratio_mean", "clip_fraction", "tis_weight_mean"):
            if key in metrics:
                self._add(key, float(metrics[key]) * tokens)  # token-weighted, divided by tokens at the end
        return loss

    def _add(self, key, value, concat=False):
        if concat:
            self.stats.setdefault(key, []).extend(value)
        else:
            self.stats[key] = self.stats.get(key, 0.0) + value

    def pop_stats(self) -> dict:
        """Token-weighted means of this step's diagnostics (this rank) and the mismatch mean / p99."""
        stats, self.stats = self.stats, {}
        tokens = max(stats.pop("tokens", 0.0), 1.0)
        out = {k: v / tokens for k, v in stats.items() if k != "mismatch"}
        gap = torch.tensor(stats.get("mismatch", [0.0]))
        out["logp mismatch mean"] = float(gap.mean())
        out["logp mismatch p99"] = float(torch.quantile(gap, 0.99)) if gap.numel() else 0.0
        return out
