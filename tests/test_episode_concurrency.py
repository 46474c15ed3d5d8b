"""Episodes scored in threads: parsing is safe from many threads at once, and an episode that raises
loses that episode only (counted, logged, run again), never its group's other episodes.

CPython 3.11 raises `SystemError: AST constructor recursion depth mismatch` when a thread switch
inside one `ast.parse` lets another thread parse (`rl.tasks.python_ast`). In a training process
the switch comes from a garbage collection that runs Python code (a finalizer, a `gc.callbacks`
hook); `_gil_released_on_collection` makes every collection yield the GIL, so the race shows up
within a second instead of once in hours."""
import contextlib
import gc
import logging
import sys
import threading
import time

import pytest

from megatron_composer.data.tool_calls import format_tool_call
from megatron_composer.inference.params import Completion
from megatron_composer.rl.agent import Agent, AgentConfig
from megatron_composer.rl.agentic import AgenticCodingEnv
from megatron_composer.rl.agentic_rewards import style_issues
from megatron_composer.rl.tasks.coding import TestVerdict, load_tasks
from megatron_composer.rl.tasks.coding.verify import expected_test_count
from megatron_composer.rl.tasks.complete_function import parses_with_body
from tests.agent_fakes import CharTokenizer

TOK = CharTokenizer()
N_TESTS = 150
TESTS = {"tests/test_many.py": "\n".join(f"def test_{i}(x=[y for y in range({i})]):\n    assert x == {i}\n"
                                         for i in range(N_TESTS))}


@contextlib.contextmanager
def _gil_released_on_collection():
    def hook(phase, info):
        time.sleep(0)  # gives up the GIL, as a finalizer doing I/O would

    interval = sys.getswitchinterval()
    gc.callbacks.append(hook)
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        gc.callbacks.remove(hook)
        sys.setswitchinterval(interval)


def _in_threads(fn, threads: int, repeats: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def work():
        for _ in range(repeats):
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)
                return

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return errors


def test_scoring_parses_are_safe_from_many_threads():
    """Verification's test count, the style reward's pyflakes pass and the complete-function verifier,
    from 8 threads at once: each gives its single-threaded value (before the lock: SystemError)."""
    changes = {"solution.py": ("", "import os\n" + TESTS["tests/test_many.py"])}
    header, body = "def f(x):\n    '''doc'''", "    return [y for y in range(x)]\n" * 40
    expected = (N_TESTS, style_issues(changes), True)
    seen = []

    def score():
        got = (expected_test_count(TESTS), style_issues(changes), parses_with_body(header, body))
        seen.append(got == expected)

    with _gil_released_on_collection():
        errors = _in_threads(score, threads=8, repeats=15)
    assert not errors, f"{len(errors)} threads failed, e.g. {errors[0]!r}"
    assert len(seen) == 8 * 15 and all(seen)


class _FinishClient:
    """Answers every turn with a `finish` call: thread-safe, so many episodes can share one agent."""

    def generate(self, prompts, params):
        ids = TOK.encode(format_tool_call("finish", {"message": "Done."})) + [TOK.chat["end"]]
        return [Completion(list(prompts[0]), ids, [-0.5] * len(ids), [-0.5] * len(ids), None,
                           [0] * len(ids), "stop")]


@pytest.fixture(scope="module")
def task():
    return load_tasks(["write-file"], "train", count=1)[0]


def _agent():
    return Agent(_FinishClient(), TOK, AgentConfig(max_context_tokens=16384, max_turn_tokens=512, max_turns=2))


_CURRENT = threading.local()  # the seed of the episode this thread runs


@pytest.fixture
def seeded_workspaces(monkeypatch):
    """`rl.agentic` with episodes that record their seed for `_counting_run_tests`."""
    import megatron_composer.rl.agentic as agentic

    real_episode = AgenticCodingEnv.episode

    def episode(self, agent, task, seed=0):
        _CURRENT.seed = seed
        return real_episode(self, agent, task, seed)

    monkeypatch.setattr(AgenticCodingEnv, "episode", episode)
    return agentic


def _counting_run_tests(fail_seeds=(), fail_runs=10**9):
    """`run_tests` that counts the pristine tests (the parse verification does) and, for `fail_seeds`,
    raises in the first `fail_runs` runs of that episode."""
    runs: dict = {}
    lock = threading.Lock()

    def run_tests(task, workspace, sandbox_kwargs=None):
        n = expected_test_count(TESTS)
        seed = _CURRENT.seed
        with lock:
            runs[seed] = runs.get(seed, 0) + 1
            failing = seed in fail_seeds and runs[seed] <= fail_runs
        if failing:
            raise OSError(f"scoring of seed {seed} failed")
        return TestVerdict(n, 0, 0, n, "", False)

    return run_tests


def test_many_episodes_score_concurrently(task, tmp_path, monkeypatch, seeded_workspaces):
    """48 episodes over 8 episode workers (--episode-workers 8), each scored by parsing the task's tests:
    every one completes with the single-threaded verdict (before the lock: SystemError, and the pool
    lost the whole batch)."""
    monkeypatch.setattr(seeded_workspaces, "run_tests", _counting_run_tests())
    env = AgenticCodingEnv(("write-file",), workdir=str(tmp_path))
    with _gil_released_on_collection():
        results = env.episodes(_agent(), [(task, s) for s in range(48)], max_workers=8)
    assert env.lost_episodes == 0
    assert [r.seed for r in results] == list(range(48))
    assert all(r.tests.total == N_TESTS and r.verdict["all_pass"] == 1.0 and r.lost == 0 for r in results)


def test_an_episode_that_raises_loses_only_itself(task, tmp_path, monkeypatch, seeded_workspaces, caplog):
    """Seed 3's scoring raises every time: its slot is None, the other 7 episodes are scored, the loss is
    counted and logged with the task, seed and error."""
    monkeypatch.setattr(seeded_workspaces, "run_tests", _counting_run_tests(fail_seeds=(3,)))
    env = AgenticCodingEnv(("write-file",), workdir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="megatron_composer.rl.agentic"):
        results = env.episodes(_agent(), [(task, s) for s in range(8)], max_workers=4, attempts=2)
    assert results[3] is None and all(r is not None and r.verdict["all_pass"] == 1.0
                                      for i, r in enumerate(results) if i != 3)
    assert env.lost_episodes == 2
    lines = [r.getMessage() for r in caplog.records]
    assert f"episode of task {task.key} (seed 3) lost, run 1 of 2: OSError: scoring of seed 3 failed" in lines
    assert f"episode of task {task.key} (seed 3) lost, run 2 of 2: OSError: scoring of seed 3 failed" in lines


def _agentic_environment(task, tmp_path, workers):
    from megatron_composer.rl.arguments import parse_rl_args
    from megatron_composer.rl.environments import build_environment

    run = parse_rl_args(["--env", "agentic-coding", "--task-families", "write-file", "--group-size", "4",
                         "--episode-workers", str(workers), "--max-new-tokens", "512", "--max-turns", "2"])
    env = build_environment(run.rl, TOK, 16384, count=1)
    env.episodes.workdir = str(tmp_path)
    assert env.task_of(0).key == task.key
    return env


def test_a_training_group_runs_a_lost_episode_again(task, tmp_path, monkeypatch, seeded_workspaces):
    """run_group under --episode-workers 4: an episode whose scoring raised once is run again and the
    group is whole; the failed run is the step's `lost episodes` metric. One that raises every time
    fails the group (the asynchronous driver launches it again), naming the group, task and seed."""
    env = _agentic_environment(task, tmp_path, workers=4)
    monkeypatch.setattr(seeded_workspaces, "run_tests", _counting_run_tests(fail_seeds=(11,), fail_runs=1))
    samples = env.run_group(_FinishClient(), 0, [10, 11, 12, 13])
    lost = {s.trajectory: s.info["lost episodes"] for s in samples}
    assert lost == {0: 0.0, 1: 1.0, 2: 0.0, 3: 0.0} and env.episodes.lost_episodes == 1
    monkeypatch.setattr(seeded_workspaces, "run_tests", _counting_run_tests(fail_seeds=(12,)))
    with pytest.raises(RuntimeError, match=rf"group 5 \(task {task.key}\): the episodes of seeds \[12\] raised 2 "
                                           r"times each"):
        env.run_group(_FinishClient(), 5, [10, 11, 12, 13])
