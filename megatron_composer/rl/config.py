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
    policy_loss: str = "dr_grpo"  # a name of policy_losses.POLICY_LOSSES
    ppo_mini_batches: int = 1  # optimizer updates per step (old log-probs computed once before the first)
    clip_eps_low: Optional[float] = None
    clip_eps_high: Optional[float] = None
    tis_cap: Optional[float] = 2.0  # truncated importance sampling against the sampler's log-probs
    reward: str = "correctness=1.0"
    length_penalty_k: float = 1e-3
    length_penalty_q: float = 0.5
    length_penalty_weights: str = ""  # "thinking=1,...,turns=0" (rewards.parse_effort_weights); "": defaults
    reward_module: str = ""  # comma list of modules that register reward terms, imported before --reward
    router_replay: bool = True
    replay_plausibility_threshold: float = 0.0
    micro_batch_tokens: int = 2048  # packed tokens per micro-batch
    rollout_batch_size: int = 64  # engine cache slots
    # the environment, a name of environments.ENVIRONMENTS: "single-turn" (one completion per sample,
    # scored by --task) or "agentic-coding" (multi-turn tool use on --task-families; max_new_tokens per turn)
    env: str = "single-turn"
    task_families: str = "write-file"
    max_turns: int = 6
    token_budget: Optional[int] = None  # generated tokens per trajectory (None: max_turns x max_new_tokens)
    max_observation_tokens: int = 192
    summary_trigger_tokens: Optional[int] = None
    max_summaries: int = 2
    summary_max_tokens: int = 96
    episode_workers: int = 16  # trajectories run at once (threads; their turns share the engine's batch)
    sandbox_timeout_s: float = 10.0
    eval_tasks: int = 0  # held-out tasks evaluated (greedy) before the first step, every eval_interval, at the end
    eval_interval: int = 0
    # textual feedback (rl/feedback.py, rl/feedback_loss.py): rules "" = off
    feedback_rules: str = ""
    feedback_coef: float = 1.0  # 0: the rules only count the mistakes (no teacher, no loss)
    feedback_kl: str = "reverse"
    feedback_kl_topk: int = 0  # 0: the full vocabulary
    feedback_teacher: str = "current"
    feedback_teacher_lag: int = 10  # steps between refreshes of the lagged teacher
    feedback_hint_role: str = "user"
    feedback_judge_url: Optional[str] = None
    feedback_long_thought_tokens: int = 64

    def __post_init__(self):
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "micro_batch_tokens", "rollout_batch_size",
                     "ppo_mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"--advantage {self.advantage!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.kl_kind not in KL_ESTIMATORS:
            raise ValueError(f"--kl-kind {self.kl_kind!r}; use one of {', '.join(KL_ESTIMATORS)}")
        from .environments import environment_class

        environment_class(self.env).check(self)
        for name in ("max_turns", "max_observation_tokens", "summary_max_tokens", "episode_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"--token-budget {self.token_budget} must be >= 1")
        if self.eval_tasks < 0 or self.eval_interval < 0:
            raise ValueError(f"--eval-tasks {self.eval_tasks} and --eval-interval {self.eval_interval} must be >= 0")
        if self.kl_placement not in KL_PLACEMENTS:
            raise ValueError(f"--kl-placement {self.kl_placement!r}; use one of {', '.join(KL_PLACEMENTS)}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef {self.kl_coef} must be >= 0")
        from .policy_losses import check_rl_sampling

        # every backend we ship returns full-vocabulary log-probs at T (`backends.check_backend`)
        check_rl_sampling(self.temperature, self.top_p)
        self._check_policy_loss()
        from .policy_losses import get_policy_loss
        from .rewards import import_reward_terms, parse_reward_weights, reward_terms

        get_policy_loss(self.policy_loss)
        import_reward_terms(self.reward_module)
        parse_reward_weights(self.reward)
        reward_terms(self)  # the length penalty's k, q and effort weights
        self._check_feedback()
        if not 0 <= self.replay_plausibility_threshold <= 1:
            raise ValueError(f"--replay-plausibility-threshold {self.replay_plausibility_threshold}; use [0, 1]")

    def _check_policy_loss(self) -> None:
        """PPO clipping only where a real old log-prob exists; clip flags only where a loss clips."""
        if self.policy_loss == "ppo_clip" and self.ppo_mini_batches < 2:
            raise ValueError("--policy-loss ppo_clip clips the ratio to the old policy, which is the trained "
                             "policy itself with one update per step (ratio 1: clipping never acts); use "
                             "--ppo-mini-batches 2 or more, or --policy-loss decoupled_ppo (against the sampler)")
        if self.policy_loss == "dr_grpo" and self.clip_eps_low is not None:
            raise ValueError(f"--clip-eps-low {self.clip_eps_low} has no effect with --policy-loss dr_grpo (no "
                             "clipping); use --policy-loss ppo_clip --ppo-mini-batches 2+, or decoupled_ppo")
        if self.clip_eps_high is not None and self.clip_eps_low is None:
            raise ValueError(f"--clip-eps-high {self.clip_eps_high} needs --clip-eps-low too")
        if self.prompts_per_step % self.ppo_mini_batches:
            raise ValueError(f"--ppo-mini-batches {self.ppo_mini_batches} must divide --prompts-per-step "
                             f"{self.prompts_per_step} (each mini-batch holds whole groups)")

    def _check_feedback(self) -> None:
        if not self.feedback_rules:
            return
        from .feedback import HINT_ROLES, resolve_rules
        from .feedback_loss import KL_DIRECTIONS, TEACHERS

        for flag, value, allowed in (("--feedback-kl", self.feedback_kl, KL_DIRECTIONS),
                                     ("--feedback-teacher", self.feedback_teacher, TEACHERS),
                                     ("--feedback-hint-role", self.feedback_hint_role, HINT_ROLES)):
            if value not in allowed:
                raise ValueError(f"{flag} {value!r}; use one of {', '.join(allowed)}")
        for flag, value in (("--feedback-coef", self.feedback_coef), ("--feedback-kl-topk", self.feedback_kl_topk)):
            if not value >= 0:
                raise ValueError(f"{flag} {value} must be >= 0")
        if self.feedback_teacher_lag < 1 or self.feedback_long_thought_tokens < 1:
            raise ValueError(f"--feedback-teacher-lag {self.feedback_teacher_lag} and "
                             f"--feedback-long-thought-tokens {self.feedback_long_thought_tokens} must be >= 1")
        # names only (the judge's client comes later)
        names = [n for n in self.feedback_rules.split(",") if n.strip() and n.strip() != "judge"]
        resolve_rules(",".join(names), long_thought_tokens=self.feedback_long_thought_tokens)

    @property
    def effort_weights(self):
        """The length penalty's `rewards.EffortWeights` (`--length-penalty-weights`)."""
        from .rewards import parse_effort_weights

        return parse_effort_weights(self.length_penalty_weights)

    @property
    def families(self) -> tuple:
        return tuple(f.strip() for f in self.task_families.split(",") if f.strip())

    @property
    def trajectory_tokens(self) -> int:
        """The most tokens one trajectory generates (the loss normalizer's per-sample length)."""
        from .environments import environment_class

        return environment_class(self.env).trajectory_tokens(self)


@dataclass(frozen=True)
class AsyncConfig:
    """The asynchronous services (`--async-rl`, rl/async_rl)."""

    enabled: bool = False
    ray_address: Optional[str] = None
    max_inflight_groups: Optional[int] = None  # default: 2 x prompts_per_step
    max_policy_lag: int = 2
    synchronous_rollouts: bool = False
    trainer_ranks: int = 1
    inference_workers: int = 1
    rollout_server: Optional[str] = None
    env_workers: int = 1
    group_timeout_s: float = 600.0
    weight_sync_dtype: str = "bf16"
    rollout_long_tail: Optional[float] = None

