"""RL environments behind one interface, chosen by name (`--env`).

    env = build_environment(rl, tokenizer, seq_length)      # rl: RLConfig, split "train"
    env.pool                                   # the tasks that fit the context; group g runs pool[g % len]
    env.assign_tasks({group_id: pool_index})   # or the pool entries a task selection chose
    env.run_group(backend, group_id, seeds)    # one group's scored samples (`batches.RolloutSample`)
    env.evaluate(backend, workers=...)         # greedy held-out episodes -> metrics, or None

Registered: `single-turn` (one completion per sample of a `--task` prompt,
scored by the task's verifier) and `agentic-coding` (multi-turn tool use in
a sandbox on `--task-families`, one sample per segment of a trajectory,
textual-feedback hints attached). Both drivers, the synchronous loop and the
asynchronous environment workers, only call this interface; nothing outside
this module branches on which environment runs. A new environment is one
more `@register_environment` class.

An agentic episode that raises (scoring or generation) loses that episode
only: it is logged, run again once, and its failed runs are the step's
`lost episodes` metric (per trajectory); a group whose episode raises twice
fails whole (the asynchronous driver launches it again, counted in `groups
failed`). A held-out evaluation scores the episodes that completed.

`--eval-task-file` is the held-out set of either environment: code tasks in
`--task-format` for single-turn, SWE instances (the `--swe-task-file`
format) for agentic-coding; both report "eval pass@1" (greedy) and "eval
pass@k" (`--eval-pass-k` samples at `--temperature`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import random
from pathlib import Path
from typing import Optional

from .batches import RolloutSample
from .registry import Registry
from .rollout import completion_sample, episode_samples, sample_seed, sampling_params

ENVIRONMENTS = Registry("environment", set_name=True)
register_environment = ENVIRONMENTS.register  # class decorator: `@register_environment("name")`


def environment_class(name: str):
    """The registered environment `name` (`--env`); ValueError listing the names otherwise."""
    return ENVIRONMENTS.get_entry(name)


def build_environment(rl, tokenizer, seq_length: int, *, split: str = "train", count: Optional[int] = None,
                      long_tail: Optional[float] = None) -> "Environment":
    """The `rl.environment.name` environment (`--env`) for contexts of `seq_length` tokens."""
    return environment_class(rl.environment.name)(rl, tokenizer, seq_length, split=split, count=count, long_tail=long_tail)


class Environment:
    """The interface (module docstring)."""

    name = "abstract"
    held_out = False  # has a held-out evaluation (`evaluate`)
    feedback = False  # its samples can carry textual-feedback hints (`set_feedback_rules`)

    @classmethod
    def check(cls, rl) -> None:
        """ValueError naming a flag of `rl` this environment cannot run with (at parse time)."""
        if rl.feedback.rules and not cls.feedback:
            raise ValueError(f"--feedback-rules reads agent trajectories; --env {cls.name} has none; use "
                             f"it with --env {', '.join(n for n, c in ENVIRONMENTS.items() if c.feedback)}")

    @classmethod
    def trajectory_tokens(cls, rl) -> int:
        """The most tokens one trajectory generates (the policy loss's per-sample length)."""
        return rl.rollout.max_new_tokens

    def __init__(self, rl, tokenizer, seq_length: int, *, split: str = "train", count: Optional[int] = None,
                 long_tail: Optional[float] = None):
        self.rl, self.tokenizer, self.seq_length = rl, tokenizer, seq_length
        self.split, self.count, self.long_tail = split, count, long_tail
        self.pool: list = []
        self.assigned: dict[int, int] = {}  # group id -> pool index (`assign_tasks`)

    def set_feedback_rules(self, rules: Optional[dict]) -> None:
        """The textual-feedback rules whose hints this environment's samples carry (`feedback` only)."""

    def seeds(self, seed: int, group_id: int) -> list[int]:
        return [sample_seed(seed, group_id, i, self.rl.rollout.group_size) for i in range(self.rl.rollout.group_size)]

    def task_of(self, group_id: int):
        return self.pool[self.assigned.get(group_id, group_id % len(self.pool))]

    def task_key(self, index: int) -> str:
        """A stable name of pool entry `index` (the solve-rate estimates' key)."""
        return self.pool[index].key

    def assign_tasks(self, assigned: dict[int, int]) -> None:
        """Run group id g on pool[assigned[g]] (the step's task selection), instead of pool[g % len]."""
        self.assigned = dict(assigned)

    def run_group(self, backend, group_id: int, seeds: list[int]) -> list[RolloutSample]:
        raise NotImplementedError

    def evaluate(self, backend, *, workers: int, shard: tuple[int, int] = (0, 1)) -> Optional[dict]:
        """Greedy held-out metrics ("eval solved", ..., "eval tasks") of this environment's tasks
        `rank::world` (`shard`), or None where the environment has no held-out evaluation."""
        return None

    def describe(self) -> str:
        raise NotImplementedError

    def _room(self) -> int:
        return self.seq_length - self.rl.rollout.max_new_tokens

    def _no_fit(self, what: str) -> ValueError:
        return ValueError(f"no {what} fits --seq-length {self.seq_length} with --max-new-tokens "
                          f"{self.rl.rollout.max_new_tokens}; raise --seq-length or lower --max-new-tokens")


@register_environment("single-turn")
class SingleTurnEnvironment(Environment):
    """One completion per sample of a `--task` prompt rendered with the chat template; held out, the
    tasks of `--eval-task-file` (`evaluate`)."""

    def __init__(self, rl, tokenizer, seq_length, **kwargs):
        super().__init__(rl, tokenizer, seq_length, **kwargs)
        from ..data.sft import render_chat
        from .tasks import CodeTestsTask, build_task

        held_out = self.split == "eval" and rl.environment.eval_task_file
        if held_out:  # always code tasks from a file, whatever --task trains on
            self.task = CodeTestsTask.from_config(rl.environment, task_file=rl.environment.eval_task_file)
        else:
            self.task = build_task(rl.environment)
        for prompt in self.task.prompts():
            ids = render_chat(list(prompt.messages), tokenizer, add_generation_prompt=True)[0]
            if len(ids) <= self._room():
                self.pool.append((prompt, ids))
        if held_out and self.count:
            self.pool = self.pool[:self.count]
        if not self.pool:
            raise self._no_fit(f"{rl.environment.task} prompt")

    def _generate(self, backend, ids, params: list) -> list:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(params))) as pool:  # one batch in the backend
            return list(pool.map(lambda p: backend.generate([ids], p)[0], params))

    def task_key(self, index: int) -> str:
        return self.pool[index][0].key

    def run_group(self, backend, group_id, seeds):
        rl, tok = self.rl, self.tokenizer
        prompt, ids = self.task_of(group_id)
        lengths, stop = [rl.rollout.max_new_tokens] * len(seeds), (tok.chat["end"], tok.eod)
        if self.long_tail:  # benchmarks: a long-tailed length per sample (Pareto, median ~ max / 8), no stop
            rng = random.Random(seeds[0])
            lengths = [max(1, min(rl.rollout.max_new_tokens, math.ceil(rl.rollout.max_new_tokens / 8 * rng.paretovariate(
                self.long_tail)))) for _ in seeds]
            stop = ()
        params = [sampling_params(rl, seed=s, max_tokens=n, stop_token_ids=stop, routed_experts=rl.algorithm.router_replay)
                  for n, s in zip(lengths, seeds)]
        generate_n = getattr(backend, "generate_n", None)  # a `RolloutBackend`'s (a bare client has none)
        if generate_n and not self.long_tail and all(s == seeds[0] + i for i, s in enumerate(seeds)):
            outs = generate_n(ids, params[0], len(seeds))  # the group as one request
        else:
            outs = self._generate(backend, ids, params)
        return [completion_sample(group_id, i, out, tok, self.task, prompt) for i, out in enumerate(outs)]

    def evaluate(self, backend, *, workers, shard: tuple[int, int] = (0, 1)):
        """`--eval-task-file`'s tasks `rank::world`: "eval pass@1" (greedy; also "eval solved" and "eval
        correctness") and "eval pass@k" (k = --eval-pass-k samples at --temperature: the fraction of tasks
        one of them solves, Chen et al.'s unbiased estimator at n = k). Sample j of task i is seeded
        `sample_seed(0, i, j, k)`, the same at every evaluation, so evaluations differ by the weights only."""
        rl, tok = self.rl, self.tokenizer
        if self.split != "eval" or not rl.environment.eval_task_file:
            return None
        k, stop = rl.rollout.eval_pass_k, (tok.chat["end"], tok.eod)

        def task_verdicts(i):
            prompt, ids = self.pool[i]
            params = [sampling_params(rl, seed=sample_seed(0, i, 0, 1), stop_token_ids=stop, routed_experts=False,
                                      temperature=0.0)]
            params += [sampling_params(rl, seed=sample_seed(0, i, j, k), stop_token_ids=stop, routed_experts=False)
                       for j in range(k)]
            outs = self._generate(backend, ids, params)
            return [completion_sample(i, j, out, tok, self.task, prompt).rewards for j, out in enumerate(outs)]

        mine = list(range(shard[0], len(self.pool), shard[1]))
        with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(mine)))) as pool:
            verdicts = list(pool.map(task_verdicts, mine))
        n = max(len(mine), 1)
        row = {"eval pass@1": sum(v[0]["all_pass"] for v in verdicts) / n,
               "eval correctness": sum(v[0]["correctness"] for v in verdicts) / n}
        row["eval solved"] = row["eval pass@1"]
        if k:
            row["eval pass@k"] = sum(any(x["all_pass"] for x in v[1:]) for v in verdicts) / n
        return dict(row, **{"eval tasks": float(len(mine))})

    def describe(self):
        described = getattr(self.task, "describe", None)
        origin = f" ({described()})" if described else ""
        return f"RL task {self.rl.environment.task}{origin}: {len(self.pool)} prompts"


@register_environment("agentic-coding")
class AgenticEnvironment(Environment):
    """Tool use in a sandbox on coding tasks (`agentic.AgenticCodingEnv`), with textual-feedback hints."""

    held_out = True
    feedback = True
    # runs of one (task, seed) in a training group before the group is lost (`agentic.AgenticCodingEnv.episodes`)
    EPISODE_ATTEMPTS = 2

    @classmethod
    def check(cls, rl) -> None:
        from .tasks.coding import FAMILIES

        from .tasks.coding import swe

        if rl.environment.task_file:
            raise ValueError(f"--task-file holds single-turn tasks; --env {cls.name} trains on --task-families "
                             "(SWE instances: --task-families swe --swe-task-file PATH); drop it, or use the "
                             "single-turn environment")
        if rl.environment.eval_task_file:  # held-out SWE instances
            try:
                swe.load_swe_tasks(str(Path(rl.environment.eval_task_file).resolve()))
            except ValueError as exc:
                raise ValueError(f"--eval-task-file {rl.environment.eval_task_file!r} with --env {cls.name} must hold "
                                 f"SWE instances (the --swe-task-file format; single-turn code tasks go with "
                                 f"--env single-turn): {exc}") from None
        unknown = [f for f in rl.environment.families if f not in FAMILIES]
        if unknown or not rl.environment.families:
            raise ValueError(f"--task-families {rl.environment.task_families!r}: unknown family "
                             f"{(unknown or [''])[0]!r}; use a comma list of {', '.join(FAMILIES)}")

    @classmethod
    def trajectory_tokens(cls, rl) -> int:
        return rl.environment.token_budget or rl.environment.max_turns * rl.rollout.max_new_tokens

    def __init__(self, rl, tokenizer, seq_length, **kwargs):
        super().__init__(rl, tokenizer, seq_length, **kwargs)
        from .agent import Agent, system_prompt
        from .agentic import AgenticCodingEnv
        from .tasks.coding import swe

        # held out with --eval-task-file: that file's SWE instances, all of them (the first --eval-tasks)
        self.held_out_file = rl.environment.eval_task_file if self.split == "eval" else ""
        held_out = swe.generate(self.held_out_file) if self.held_out_file else None
        self.episodes = AgenticCodingEnv(("swe",) if held_out else rl.environment.families, split=self.split,
                                         count=self.count, sandbox_kwargs={"timeout_s": rl.environment.sandbox_timeout_s},
                                         swe_task_file=rl.environment.swe_task_file or None, tasks=held_out)
        probe = Agent(None, tokenizer, self.agent_config(routed_experts=False))
        self.pool = [t for t in self.episodes.tasks() if len(probe.segment_prompt(
            system_prompt(self.episodes.tool_names), t.instruction, None)) <= self._room()]
        if not self.pool:
            raise self._no_fit(f"{','.join(rl.environment.families)} task")
        self.rules: Optional[dict] = None  # feedback rules (`set_feedback_rules`)

    def agent_config(self, *, routed_experts: bool, **overrides):
        """The `agent.AgentConfig` of train_rl.py's flags for this environment's context."""
        from .agent import AgentConfig

        rl = self.rl
        config = AgentConfig(max_turns=rl.environment.max_turns, max_turn_tokens=rl.rollout.max_new_tokens,
                             max_context_tokens=self.seq_length, max_total_tokens=rl.environment.token_budget,
                             max_observation_tokens=rl.environment.max_observation_tokens,
                             summary_trigger_tokens=rl.environment.summary_trigger_tokens, max_summaries=rl.environment.max_summaries,
                             summary_max_tokens=rl.environment.summary_max_tokens, temperature=rl.rollout.temperature,
                             top_p=rl.rollout.top_p, return_routed_experts=routed_experts)
        return dataclasses.replace(config, **overrides)

    def set_feedback_rules(self, rules: Optional[dict]) -> None:
        self.rules = rules or None

    def run_group(self, backend, group_id, seeds):
        from .agent import Agent

        rl = self.rl
        agent = Agent(backend, self.tokenizer, self.agent_config(routed_experts=rl.algorithm.router_replay))
        task = self.task_of(group_id)
        results = self.episodes.episodes(agent, [(task, s) for s in seeds], max_workers=rl.environment.episode_workers,
                                         attempts=self.EPISODE_ATTEMPTS)
        failed = [s for s, r in zip(seeds, results) if r is None]
        if failed:  # a group trains whole (its advantages compare all its trajectories)
            raise RuntimeError(f"group {group_id} (task {task.key}): the episodes of seeds {failed} raised "
                               f"{self.EPISODE_ATTEMPTS} times each (logged above); the group is lost")
        return episode_samples(results, [group_id] * len(seeds), rl.rollout.group_size, self.tokenizer, self.rules,
                               rl.feedback.hint_role)

    def evaluate(self, backend, *, workers, shard: tuple[int, int] = (0, 1), temperature: float = 0.0,
                 seed: int = 0):
        """Episodes of tasks `rank::world` of `shard` (episode seed = task index + seed x 1000003; greedy
        unless `temperature`): `agentic.summarize`'s row prefixed "eval " ("eval solved", "eval correctness",
        "eval turns", ...).

        With `--eval-task-file` (held-out SWE instances) also "eval pass@1", the fraction of tasks whose
        greedy episode resolved them, and "eval pass@k": k = `--eval-pass-k` episodes per task at
        `--temperature`, episode j of task i seeded `sample_seed(0, i, j, k)` (the same at every evaluation),
        the fraction of tasks one of them resolves (Chen et al.'s unbiased estimator at n = k). An episode
        that raised counts as unsolved; "eval tasks" is then the number of tasks of the shard."""
        from .agent import Agent
        from .agentic import summarize

        agent = Agent(backend, self.tokenizer, self.agent_config(routed_experts=False, temperature=temperature))
        tasks = self.episodes.tasks()
        mine = list(range(shard[0], len(tasks), shard[1]))
        results = self.episodes.episodes(agent, [(tasks[i], i + seed * 1_000_003) for i in mine], max_workers=workers)
        row = summarize([r for r in results if r is not None], self.tokenizer)  # "tasks": those scored
        row = {f"eval {k}": float(v) if isinstance(v, (int, float)) else v for k, v in row.items()}
        if not self.held_out_file:
            return row

        def solved(result) -> bool:
            return result is not None and bool(result.verdict["all_pass"])

        n, k = max(len(mine), 1), self.rl.rollout.eval_pass_k
        row.update({"eval pass@1": sum(map(solved, results)) / n, "eval tasks": float(len(mine))})
        if k:
            sampler = Agent(backend, self.tokenizer, self.agent_config(routed_experts=False))
            jobs = [(tasks[i], sample_seed(0, i, j, k)) for i in mine for j in range(k)]
            sampled = self.episodes.episodes(sampler, jobs, max_workers=workers)
            row["eval pass@k"] = sum(any(map(solved, sampled[t * k:(t + 1) * k])) for t in range(len(mine))) / n
        return row

    def describe(self):
        from .tasks.coding import swe

        rl = self.rl
        text = (f"RL env {self.name} ({rl.environment.task_families}): {len(self.pool)} tasks, up to {rl.environment.max_turns} turns "
                f"of {rl.rollout.max_new_tokens} tokens, summaries at {rl.environment.summary_trigger_tokens or 'never'}")
        problems = swe.problems_of(rl.environment.swe_task_file or None) if swe.FAMILY in rl.environment.families else ()
        if problems:
            text += f"; {len(problems)} bad SWE instance(s) skipped, the first: {problems[0]}"
        return text


def merge_evaluations(parts: list[dict]) -> dict:
    """The metrics of the whole held-out set from the shards' (each a mean over its "eval tasks")."""
    total = sum(p["eval tasks"] for p in parts)
    merged = {}
    for k, v in parts[0].items():
        if k == "eval tasks":
            continue
        if isinstance(v, float):
            merged[k] = sum(p[k] * p["eval tasks"] for p in parts) / max(total, 1.0)
        else:  # text (the stop reasons): each shard's
            merged[k] = "; ".join(str(p[k]) for p in parts if p[k])
    return dict(merged, **{"eval tasks": float(total)})

