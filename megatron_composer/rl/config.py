"""The RL stage's settings (`train_rl.py` flags), beside the shared `TrainingConfig`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS

KL_PLACEMENTS = ("reward", "loss")


@dataclass(frozen=True)
class RLConfig:
    """What one RL step samples, how it is scored and how the policy loss is formed."""

    task: str = "complete-function"
    group_size: int = 8  # samples per prompt
    prompts_per_step: int = 4  # groups per step; each prompt is used once (in order, then again)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    advantage: str = "dr_grpo"
    kl_coef: float = 0.0
    kl_kind: str = "k1"
    kl_placement: str = "reward"
    clip_eps_low: Optional[float] = None
    clip_eps_high: Optional[float] = None
    tis_cap: Optional[float] = 2.0  # truncated importance sampling against the sampler's log-probs
    reward: str = "correctness=1.0"
    length_penalty_k: float = 1e-3
    length_penalty_q: float = 0.5
    router_replay: bool = True
    replay_plausibility_threshold: float = 0.0
    micro_batch_tokens: int = 2048  # packed tokens per micro-batch
    rollout_batch_size: int = 64  # engine cache slots

    def __post_init__(self):
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "micro_batch_tokens", "rollout_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"--advantage {self.advantage!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.kl_kind not in KL_ESTIMATORS:
            raise ValueError(f"--kl-kind {self.kl_kind!r}; use one of {', '.join(KL_ESTIMATORS)}")
        if self.kl_placement not in KL_PLACEMENTS:
            raise ValueError(f"--kl-placement {self.kl_placement!r}; use one of {', '.join(KL_PLACEMENTS)}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef {self.kl_coef} must be >= 0")
        if self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature}: RL samples (> 0); greedy groups have no variance")
        from .rewards import LengthPenaltyConfig, parse_reward_weights

        parse_reward_weights(self.reward)
        LengthPenaltyConfig(k=self.length_penalty_k, q=self.length_penalty_q)
        if not 0 <= self.replay_plausibility_threshold <= 1:
            raise ValueError(f"--replay-plausibility-threshold {self.replay_plausibility_threshold}; use [0, 1]")
