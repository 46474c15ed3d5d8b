"""The agentic coding environment: one episode is a task's workspace, its sandbox and tools,
the agent's trajectory, and the verdict of the task's tests.

    env = AgenticCodingEnv(families=("write-file",))
    agent = Agent(client, tokenizer, AgentConfig(max_turns=4))
    result = env.episode(agent, env.tasks()[0], seed=0)
    result.verdict   # {"correctness": 1.0, "all_pass": 1.0, "style": 0.0, "communication": 1.0, ...}

An episode writes the task's files into a fresh temporary workspace
(`tasks.coding.prepare_workspace`, which removes caches), runs the agent with
the tools on it (`run` and the model's `run_tests` in a `Sandbox` on that
workspace), then verifies: the task's pristine tests run on a fresh copy of
the workspace (`tasks.coding.run_tests`, with its reward-hacking defenses).
The verdict holds one value per reward term (`rewards.REWARD_TERMS`):

    correctness     fraction of the task's tests that pass
    all_pass        1.0 when every test passes
    style           -(pyflakes warnings and reasoning left in comments) on the changed lines
    communication   1.0 when `finish` carried a final message of sensible length
    tool_misuse     -(misused calls: malformed, unknown tool, bad arguments, the terminal
                    for a dedicated tool, open to-do items at finish, no call at all)
    parallel_tool_calls  share of the read-only calls batched with another in one message
    tool_efficiency -(redundant calls: rereads, relistings, retests, calls after solving)

A task of the swe family (`tasks.coding.swe`) counts its FAIL_TO_PASS and
PASS_TO_PASS ids: all_pass is "resolved", and the verdict adds `resolved`,
`fail_to_pass` and `pass_to_pass` (the fractions), logged as task metrics.

`episodes` runs many in threads: the model's turns from all of them meet in
the engine's batch, and their sandboxes run side by side. An episode that
raises (its generation or its scoring) is lost alone: the others run on, the
loss is logged with the task, seed and error and counted (`lost_episodes`,
and `EpisodeResult.lost` for the failed attempts before a result), and it is
tried again up to `attempts` times. Every parse of scored code holds one
lock (`tasks.python_ast`): CPython 3.11's parser is not safe from threads.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

from .agent import Agent, Trajectory
from .agentic_rewards import (changed_files, communication_score, parallel_tool_calls_score, style_score,
                              tool_efficiency_score, tool_misuse_score)
from .sandbox import Sandbox
from .task_envs import sandbox_kwargs_for
from .tasks.coding import CodingTask, SweVerdict, TestVerdict, load_tasks, prepare_workspace, run_tests
from .tasks.python_ast import PARSE_LOCK
from .tools import TOOLS, ToolSet

ENV_NAME = "agentic-coding"
log = logging.getLogger(__name__)


def test_report(verdict: TestVerdict) -> str:
    """What `run_tests` shows the model: the counts, then the runner's output."""
    head = (f"{verdict.passed} passed, {verdict.failed} failed, {verdict.errors} errors of {verdict.total} tests"
            + (" (timed out)" if verdict.timed_out else ""))
    return f"{head}\n{verdict.output.strip()}" if verdict.output.strip() else head


@dataclasses.dataclass
class EpisodeResult:
    task: CodingTask
    seed: int
    trajectory: Trajectory
    verdict: dict  # reward term -> value (module docstring)
    tests: TestVerdict
    lost: int = 0  # failed attempts of this (task, seed) before this one (`AgenticCodingEnv.episodes`)


class AgenticCodingEnv:
    """Coding tasks of `families` (`tasks.coding.FAMILIES`) as agent episodes.

    Args:
        families: task family names; split: "train" or "eval"; count: at most this many tasks.
        tool_names: the tools offered (default: all of `tools.TOOLS`).
        sandbox_kwargs: limits for every `Sandbox` of an episode (timeout_s, memory_mb, ...).
        workdir: where temporary workspaces go (default: the system's temp dir).
        swe_task_file: the instances of the swe family (default: its embedded set).
        tasks: these tasks, in this order, in place of `families`' tasks of `split` (held-out files).
    """

    name = ENV_NAME

    def __init__(self, families: Sequence[str] = ("write-file",), *, split: str = "train",
                 count: Optional[int] = None, tool_names: Sequence[str] = tuple(TOOLS),
                 sandbox_kwargs: Optional[dict] = None, workdir: Optional[str] = None,
                 swe_task_file: Optional[str] = None, tasks: Optional[Sequence[CodingTask]] = None):
        self.families, self.split, self.count = tuple(families), split, count
        self.swe_task_file = swe_task_file or None
        self.tool_names = tuple(tool_names)
        self.sandbox_kwargs = dict(sandbox_kwargs or {})
        self.workdir = workdir
        self._tasks: Optional[list[CodingTask]] = None if tasks is None else list(tasks)[:count]
        self.lost_episodes = 0  # episodes that raised, over this object's life (`episodes`)
        self._lost_lock = threading.Lock()

    def tasks(self) -> list[CodingTask]:
        if self._tasks is None:
            self._tasks = load_tasks(self.families, self.split, count=self.count, swe_task_file=self.swe_task_file)
            if not self._tasks:
                raise ValueError(f"no {self.split} tasks in the families {', '.join(self.families)}")
        return self._tasks

    def episode(self, agent: Agent, task: CodingTask, seed: int = 0) -> EpisodeResult:
        """One trajectory on `task` in a fresh workspace, verified by its pristine tests."""
        with tempfile.TemporaryDirectory(prefix="episode-", dir=self.workdir) as tmp:
            workspace = Path(tmp) / "workspace"
            prepare_workspace(task, workspace)
            sandbox_kwargs = sandbox_kwargs_for(task, self.sandbox_kwargs)  # a task's own environment, if any
            sandbox = Sandbox(workspace, **sandbox_kwargs)
            tools = ToolSet(workspace, sandbox, names=self.tool_names,
                            run_tests=lambda: test_report(run_tests(task, workspace, sandbox_kwargs=sandbox_kwargs)))
            try:
                trajectory = agent.run(tools, task.instruction, seed=seed)
            except Exception as exc:
                raise RuntimeError(f"episode of task {task.key} (seed {seed}) failed: {exc}") from exc
            tests = run_tests(task, workspace, sandbox_kwargs=sandbox_kwargs)
            changes = changed_files(task.files, workspace)
        verdict = {"correctness": tests.fraction, "all_pass": float(tests.all_pass),
                   "style": style_score(changes), "communication": communication_score(trajectory.final_message),
                   "tool_misuse": tool_misuse_score(trajectory.events, tools.open_todo_items()),
                   "parallel_tool_calls": parallel_tool_calls_score(
                       [t.events for t in trajectory.turns if t.kind == "action"]),
                   "tool_efficiency": tool_efficiency_score(trajectory.events)}
        if isinstance(tests, SweVerdict):
            verdict.update(resolved=float(tests.resolved), fail_to_pass=tests.fail_to_pass,
                           pass_to_pass=tests.pass_to_pass)
        return EpisodeResult(task, seed, trajectory, verdict, tests)

    def episodes(self, agent: Agent, jobs: Sequence[tuple[CodingTask, int]], *, max_workers: int = 16,
                 attempts: int = 1) -> list[Optional[EpisodeResult]]:
        """`episode(agent, task, seed)` for every (task, seed), run in threads; results in order.

        An episode that raises is lost alone (module docstring) and run again, up to `attempts` runs in
        all; its slot is None when every run raised."""
        if not jobs:
            return []

        def run(job: tuple[CodingTask, int]) -> Optional[EpisodeResult]:
            for attempt in range(attempts):
                try:
                    return dataclasses.replace(self.episode(agent, *job), lost=attempt)
                except Exception as exc:  # noqa: BLE001 - one episode's failure is not the others'
                    self._lose(job, attempt, attempts, exc)
            return None

        with concurrent.futures.ThreadPoolExecutor(min(max_workers, len(jobs)),
                                                   thread_name_prefix="episode") as pool:
            return list(pool.map(run, jobs))

    def _lose(self, job: tuple[CodingTask, int], attempt: int, attempts: int, exc: Exception) -> None:
        with self._lost_lock:
            self.lost_episodes += 1
        task, seed = job
        # under the parse lock: Python 3.11's traceback formatting parses source lines with ast.parse (for
        # its ^^^ markers), which must not overlap another thread's parse (tasks/python_ast.py)
        with PARSE_LOCK:
            log.warning("episode of task %s (seed %d) lost, run %d of %d: %s: %s", task.key, seed, attempt + 1,
                        attempts, type(exc).__name__, exc, exc_info=True)


def summarize(results, tokenizer) -> dict:
    """Mean metrics over episode results (the held-out evaluations of `environments` and `rl.evaluate`):
    "turns" is model turns per episode, "calls per turn" the mean over episodes of tool calls / turns,
    "turns per solved" the mean turns of the solved episodes (0.0 when none is solved)."""
    from .rollout import calls_per_turn

    n = max(1, len(results))
    solved = [r for r in results if r.verdict["all_pass"] >= 1.0]
    summaries = [s for r in results for s in r.trajectory.summaries]
    stops = collections.Counter(r.trajectory.stop_reason for r in results)
    row = {"tasks": len(results),
           "solved": sum(r.verdict["all_pass"] for r in results) / n,
           "correctness": sum(r.verdict["correctness"] for r in results) / n,
           "tool misuse": sum(r.verdict["tool_misuse"] for r in results) / n,
           "turns": sum(r.trajectory.counts.turns for r in results) / n,
           "turns per solved": (sum(r.trajectory.counts.turns for r in solved) / len(solved)) if solved else 0.0,
           "tool calls": sum(r.trajectory.counts.tool_calls for r in results) / n,
           "calls per turn": sum(calls_per_turn(r.trajectory.counts) for r in results) / n,
           "parallel tool calls": sum(r.verdict["parallel_tool_calls"] for r in results) / n,
           "tool efficiency": sum(r.verdict["tool_efficiency"] for r in results) / n,
           "summaries": len(summaries) / n,
           "summary tokens": (sum(len(tokenizer.encode(s)) for s in summaries) / len(summaries)) if summaries else 0.0,
           "generated tokens": sum(r.trajectory.generated_tokens for r in results) / n}
    row["stops"] = ", ".join(f"{k} {v}" for k, v in sorted(stops.items()))
    return row
