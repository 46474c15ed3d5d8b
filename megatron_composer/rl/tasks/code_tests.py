"""The file task (`--task code-tests`, implied by `--task-file`): code completions scored by running tests.

Tasks come from `--task-file` in `--task-format` (`task_files`). A
completion's code is the inside of its ```python fence (all of it without
one). The program run is the task's `setup`, then, for a task with a
`code_prefix` (HumanEval's signature and docstring), that prefix followed by
the code: the code continues it when it does not itself define the entry
point (a body), else it follows on a new line (a whole function, which
replaces the stub). Its verdict, from `code_harness` run in the bubblewrap
sandbox (`sandbox.Sandbox`, no network, nothing of the host but the system
Python):

    correctness  the fraction of test units passed (assert statements, or
                 test functions; `code_harness`)
    all_pass     1.0 when every unit passed, else 0.0

A run past the task's `timeout_s` (default `--sandbox-timeout-s`) keeps the
units reported before the wall clock.
"""
from __future__ import annotations

import ast
import json
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from .complete_function import TaskPrompt, completion_code
from .python_ast import parse_python
from .task_files import CodeTask, load_code_tasks

HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
EXAMPLE_TASKS = Path(__file__).parent / "examples" / "tasks.jsonl"  # hand-written, for docs and tests


def defines_function(code: str, name: str) -> bool:
    """Whether `code` parses and defines `name` at top level."""
    try:
        tree = parse_python(code, quiet=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def program_of(task: CodeTask, code: str) -> str:
    """The source run against the tests for a completion's `code` (module docstring)."""
    if task.code_prefix:
        joiner = "\n" if defines_function(code, task.entry_point) else ""
        code = task.code_prefix + joiner + code
    return f"{task.setup}\n{code}" if task.setup else code


def run_code_tests(task: CodeTask, program: str, timeout_s: float) -> tuple[int, int]:
    """(units passed, units in the tests) of `program` under `task`'s tests, run in a fresh sandbox."""
    from ..sandbox import Sandbox
    from ..task_envs import task_env_site_packages
    from .code_harness import unit_count
    from .python_ast import PARSE_LOCK

    with PARSE_LOCK:
        total = unit_count(task.tests)
    nonce = secrets.token_hex(16)
    spec = json.dumps({"nonce": nonce, "program": program, "tests": task.tests, "entry_point": task.entry_point})
    workspace = tempfile.mkdtemp(prefix="code_tests_")
    try:
        site = task_env_site_packages(task.requirements) if task.requirements else None
        result = Sandbox(workspace, timeout_s=task.timeout_s or timeout_s, site_packages=site,
                         rootfs=task.rootfs or None).run(["python3", "-c", HARNESS], stdin=spec)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    verdicts: dict[int, bool] = {}
    for line in result.stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and parts[2] in ("pass", "fail"):
            verdicts.setdefault(int(parts[1]), parts[2] == "pass")
    return sum(ok for i, ok in verdicts.items() if i < total), total


class CodeTestsTask:
    """Tasks of a file, each prompt the task's user turn; verified by its tests in the sandbox."""

    name = "code-tests"

    def __init__(self, task_file: str, task_format: str = "jsonl", timeout_s: float = 10.0):
        if not task_file:
            raise ValueError("--task code-tests reads its tasks from --task-file; give --task-file PATH "
                             f"(for example {EXAMPLE_TASKS})")
        self.task_file, self.task_format, self.timeout_s = task_file, task_format, timeout_s
        self.tasks, self.problems = load_code_tasks(task_file, task_format)
        self._by_id = {t.id: t for t in self.tasks}

    @classmethod
    def from_config(cls, environment, *, task_file: Optional[str] = None) -> "CodeTestsTask":
        """The task of an `EnvironmentConfig` (`task_file` overrides its --task-file: the held-out file)."""
        return cls(task_file or environment.task_file, environment.task_format, environment.sandbox_timeout_s)

    def prompts(self) -> list[TaskPrompt]:
        return [TaskPrompt(t.id, ({"role": "user", "content": t.prompt},), t.code_prefix) for t in self.tasks]

    def verify(self, prompt: TaskPrompt, completion: str) -> dict[str, float]:
        """{"correctness": units passed / units, "all_pass": 0 or 1} (module docstring)."""
        task = self._by_id[prompt.key]
        passed, total = run_code_tests(task, program_of(task, completion_code(completion)), self.timeout_s)
        return {"correctness": passed / total, "all_pass": float(passed == total)}

    def describe(self) -> str:
        """Where the tasks came from and how many records were bad (with the first)."""
        text = f"{len(self.tasks)} tasks from {self.task_file} ({self.task_format})"
        if self.problems:
            text += f"; {len(self.problems)} bad record(s) skipped, the first: {self.problems[0]}"
        return text
