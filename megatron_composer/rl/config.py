"""The RL stage's settings (`train_rl.py` flags), beside the shared `TrainingConfig`.

    RLConfig
      rollout      what a step samples: groups, group size, tokens, temperature (`rollout.py`, backends)
      algorithm    advantages, the policy loss and its off-policy corrections, KL, router replay, packing
      reward       the `--reward` terms, the length penalty, user modules of reward terms (`rewards.py`)
      environment  `--env` and what it needs: tasks, turns, summaries, the sandbox (`environments.py`)
      feedback     textual feedback: hint rules, the teacher and its KL (`feedback.py`, `feedback_loss.py`)
      vllm         the vLLM server of `--rollout-backend vllm` (`vllm_server.VLLMConfig`, `--vllm-*`)
      sglang       the SGLang servers of `--rollout-backend sglang` (`sglang_backend.SGLangConfig`, `--sglang-*`)
    AsyncConfig    the asynchronous services (`--async-rl`)

Each section checks its own values; `RLConfig` checks what spans sections.
`RLConfig.from_flat(**fields)` builds all of it from the flags' names
(`rl.arguments.parse_rl_args` and tests), once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from .sglang_backend import SGLangConfig
from .vllm_server import VLLMConfig

KL_PLACEMENTS = ("reward", "loss")
# where the synchronous loop's samples come from: our engine colocated with the trainer, a vLLM server or
# SGLang servers
ROLLOUT_BACKENDS = ("engine", "vllm", "sglang")


def _at_least(section, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(section, name) < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(section, name)}")


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8  # samples per prompt
    prompts_per_step: int = 4  # groups per step; each prompt is used once (in order, then again)
    max_new_tokens: int = 64  # per turn in a multi-turn environment
    temperature: float = 1.0
    top_p: float = 1.0
    rollout_batch_size: int = 64  # engine cache slots
    eval_tasks: int = 0  # held-out tasks evaluated (greedy) before the first step, every eval_interval, at the end
    eval_interval: int = 0
    backend: str = "engine"  # --rollout-backend: one of ROLLOUT_BACKENDS
    eval_pass_k: int = 4  # --eval-task-file: samples per held-out task for pass@k (0: greedy pass@1 only)
    task_selection: str = "cycle"  # cycle: group g runs pool[g % len]; solve-rate: `task_selection`
    task_solve_rate_bounds: str = "0.1,0.9"  # the solve-rate estimates a selected task lies within

    def __post_init__(self):
        from .policy_losses import check_rl_sampling
        from .task_selection import SELECTIONS, parse_bounds

        if self.backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"--rollout-backend {self.backend!r}; use one of {', '.join(ROLLOUT_BACKENDS)}")
        if self.task_selection not in SELECTIONS:
            raise ValueError(f"--task-selection {self.task_selection!r}; use one of {', '.join(SELECTIONS)}")
        parse_bounds(self.task_solve_rate_bounds)
        _at_least(self, 1, "group_size", "prompts_per_step", "max_new_tokens", "rollout_batch_size")
        _at_least(self, 0, "eval_tasks", "eval_interval", "eval_pass_k")
        # every backend returns full-vocabulary log-probs at T (`backends`): no truncation in RL
        check_rl_sampling(self.temperature, self.top_p)


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: str = "dr_grpo"
    policy_loss: str = "dr_grpo"  # a name of policy_losses.POLICY_LOSSES
    ppo_mini_batches: int = 1  # optimizer updates per step (old log-probs computed once before the first)
    clip_eps_low: Optional[float] = None
    clip_eps_high: Optional[float] = None
    tis_cap: Optional[float] = 2.0  # truncated importance sampling against the sampler's log-probs
    kl_coef: float = 0.0
    kl_kind: str = "k1"
    kl_placement: str = "reward"
    reference_offload: bool = False  # the reference's weights in host memory between its forwards
    router_replay: bool = True
    replay_plausibility_threshold: float = 0.0
    micro_batch_tokens: int = 2048  # packed tokens per micro-batch
    drop_zero_signal_groups: bool = False  # leave groups whose samples share one reward out of the update

    def __post_init__(self):
        from .policy_losses import get_policy_loss

        _at_least(self, 1, "micro_batch_tokens", "ppo_mini_batches")
        for flag, value, allowed in (("--advantage", self.advantage, ADVANTAGE_ESTIMATORS),
                                     ("--kl-kind", self.kl_kind, KL_ESTIMATORS),
                                     ("--kl-placement", self.kl_placement, KL_PLACEMENTS)):
            if value not in allowed:
                raise ValueError(f"{flag} {value!r}; use one of {', '.join(allowed)}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef {self.kl_coef} must be >= 0")
        if not 0 <= self.replay_plausibility_threshold <= 1:
            raise ValueError(f"--replay-plausibility-threshold {self.replay_plausibility_threshold}; use [0, 1]")
        get_policy_loss(self.policy_loss)
        # PPO clipping only where a real old log-prob exists; clip flags only where a loss clips
        if self.policy_loss == "ppo_clip" and self.ppo_mini_batches < 2:
            raise ValueError("--policy-loss ppo_clip clips the ratio to the old policy, which is the trained "
                             "policy itself with one update per step (ratio 1: clipping never acts); use "
                             "--ppo-mini-batches 2 or more, or --policy-loss decoupled_ppo (against the sampler)")
        if self.policy_loss == "dr_grpo" and self.clip_eps_low is not None:
            raise ValueError(f"--clip-eps-low {self.clip_eps_low} has no effect with --policy-loss dr_grpo (no "
                             "clipping); use --policy-loss ppo_clip --ppo-mini-batches 2+, or decoupled_ppo")
        if self.clip_eps_high is not None and self.clip_eps_low is None:
            raise ValueError(f"--clip-eps-high {self.clip_eps_high} needs --clip-eps-low too")


@dataclass(frozen=True)
class RewardConfig:
    terms: str = "correctness=1.0"  # --reward: weighted terms
    length_penalty_k: float = 1e-3
    length_penalty_q: float = 0.5
    length_penalty_weights: str = ""  # "thinking=1,...,turns=0" (rewards.parse_effort_weights); "": defaults
    modules: str = ""  # --reward-module: comma list of modules that register terms, imported before --reward

    def __post_init__(self):
        from .rewards import import_reward_terms, parse_reward_weights, reward_terms

        import_reward_terms(self.modules)
        parse_reward_weights(self.terms)
        reward_terms(self)  # the length penalty's k, q and effort weights

    @property
    def effort_weights(self):
        """The length penalty's `rewards.EffortWeights` (`--length-penalty-weights`)."""
        from .rewards import parse_effort_weights

        return parse_effort_weights(self.length_penalty_weights)


@dataclass(frozen=True)
class EnvironmentConfig:
    # a name of environments.ENVIRONMENTS: "single-turn" (one completion per sample, scored by --task) or
    # "agentic-coding" (multi-turn tool use on --task-families; max_new_tokens per turn)
    name: str = "single-turn"
    task: str = "complete-function"
    task_file: str = ""  # --task code-tests: a JSONL/parquet file or a directory of shards (tasks.task_files)
    task_format: str = "jsonl"  # jsonl | humaneval | mbpp
    eval_task_file: str = ""  # held-out tasks (single-turn: code tasks, agentic: SWE instances) for pass@1 / pass@k at --eval-interval
    task_families: str = "write-file"
    swe_task_file: str = ""  # the swe family's SWE-bench style instances (JSONL; tasks.coding.swe); "": embedded
    max_turns: int = 6
    token_budget: Optional[int] = None  # generated tokens per trajectory (None: max_turns x max_new_tokens)
    max_observation_tokens: int = 192
    summary_trigger_tokens: Optional[int] = None
    max_summaries: int = 2
    summary_max_tokens: int = 96
    episode_workers: int = 16  # trajectories run at once (threads; their turns share the engine's batch)
    sandbox_timeout_s: float = 10.0

    def __post_init__(self):
        from .environments import environment_class

        from .tasks import TASKS
        from .tasks.task_files import FORMATS

        environment_class(self.name)
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task!r}; use one of {', '.join(sorted(TASKS))}")
        if self.task_format not in FORMATS:
            raise ValueError(f"--task-format {self.task_format!r}; use one of {', '.join(FORMATS)}")
        if (self.task == "code-tests") != bool(self.task_file):
            raise ValueError(f"--task {self.task} with --task-file {self.task_file!r}: --task-file is read by "
                             "--task code-tests and that task needs it; give both, or neither")
        if self.swe_task_file and (self.name != "agentic-coding" or "swe" not in self.families):
            raise ValueError(f"--swe-task-file {self.swe_task_file!r} is read by the swe family of --env "
                             f"agentic-coding (here --env {self.name}, --task-families {self.task_families!r}); "
                             "add --env agentic-coding and swe to --task-families, or drop --swe-task-file")
        _at_least(self, 1, "max_turns", "max_observation_tokens", "summary_max_tokens", "episode_workers")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"--token-budget {self.token_budget} must be >= 1")

    @property
    def families(self) -> tuple:
        return tuple(f.strip() for f in self.task_families.split(",") if f.strip())


@dataclass(frozen=True)
class FeedbackConfig:
    rules: str = ""  # --feedback-rules; "": off
    coef: float = 1.0  # 0: the rules only count the mistakes (no teacher, no loss)
    kl: str = "reverse"
    kl_topk: int = 0  # 0: the full vocabulary
    teacher: str = "current"
    teacher_lag: int = 10  # steps between refreshes of the lagged teacher
    hint_role: str = "user"
    judge_url: Optional[str] = None
    long_thought_tokens: int = 64

    def __post_init__(self):
        if not self.rules:
            return
        from .feedback import HINT_ROLES, resolve_rules
        from .feedback_loss import KL_DIRECTIONS, TEACHERS

        for flag, value, allowed in (("--feedback-kl", self.kl, KL_DIRECTIONS),
                                     ("--feedback-teacher", self.teacher, TEACHERS),
                                     ("--feedback-hint-role", self.hint_role, HINT_ROLES)):
            if value not in allowed:
                raise ValueError(f"{flag} {value!r}; use one of {', '.join(allowed)}")
        for flag, value in (("--feedback-coef", self.coef), ("--feedback-kl-topk", self.kl_topk)):
            if not value >= 0:
                raise ValueError(f"{flag} {value} must be >= 0")
        if self.teacher_lag < 1 or self.long_thought_tokens < 1:
            raise ValueError(f"--feedback-teacher-lag {self.teacher_lag} and "
                             f"--feedback-long-thought-tokens {self.long_thought_tokens} must be >= 1")
        # names only (the judge's client comes later)
        names = [n for n in self.rules.split(",") if n.strip() and n.strip() != "judge"]
        resolve_rules(",".join(names), long_thought_tokens=self.long_thought_tokens)


# flag dest -> (section, field) where the names differ; every other dest is a field of its section, prefixed
# with the section's name in the sections of _PREFIXED
_RENAMED = {"env": ("environment", "name"), "reward": ("reward", "terms"), "reward_module": ("reward", "modules"),
            "rollout_backend": ("rollout", "backend")}
_SECTIONS = {"rollout": RolloutConfig, "algorithm": AlgorithmConfig, "reward": RewardConfig,
             "environment": EnvironmentConfig, "feedback": FeedbackConfig, "vllm": VLLMConfig,
             "sglang": SGLangConfig}
_PREFIXED = ("feedback", "vllm", "sglang")


@dataclass(frozen=True)
class RLConfig:
    """What one RL step samples, how it is scored and how the policy loss is formed (module docstring)."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def __post_init__(self):
        from .environments import environment_class

        environment_class(self.environment.name).check(self)
        if self.rollout.prompts_per_step % self.algorithm.ppo_mini_batches:
            raise ValueError(f"--ppo-mini-batches {self.algorithm.ppo_mini_batches} must divide --prompts-per-step "
                             f"{self.rollout.prompts_per_step} (each mini-batch holds whole groups)")

    @classmethod
    def flag_names(cls) -> dict[str, tuple[str, str]]:
        """{flag dest: (section, field)} of every RL flag."""
        names = {}
        flag = lambda section, name: f"{section}_{name}" if section in _PREFIXED else name  # noqa: E731
        for section, kind in _SECTIONS.items():
            for name in kind.__dataclass_fields__:
                names[flag(section, name)] = (section, name)
        for dest, (section, name) in _RENAMED.items():
            names.pop(flag(section, name), None)
            names[dest] = (section, name)
        return names

    @classmethod
    def from_flat(cls, **values) -> "RLConfig":
        """The config of flag-named values (`group_size=4, env="agentic-coding", feedback_rules=...`);
        unnamed fields keep their defaults."""
        names = cls.flag_names()
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise TypeError(f"unknown RL setting {unknown[0]!r}; the settings are {', '.join(sorted(names))}")
        sections: dict[str, dict] = {s: {} for s in _SECTIONS}
        for dest, value in values.items():
            section, name = names[dest]
            sections[section][name] = value
        return cls(**{s: _SECTIONS[s](**v) for s, v in sections.items()})

    def replace(self, **values) -> "RLConfig":
        """A copy with flag-named values changed (`rl.replace(temperature=0.0)`)."""
        flat = {dest: getattr(getattr(self, s), n) for dest, (s, n) in self.flag_names().items()}
        return self.from_flat(**{**flat, **values})

    @property
    def trajectory_tokens(self) -> int:
        """The most tokens one trajectory generates (the loss normalizer's per-sample length)."""
        from .environments import environment_class

        return environment_class(self.environment.name).trajectory_tokens(self)


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

