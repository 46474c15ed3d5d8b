"""RL tasks: prompts and the verifier that scores a completion.

A task gives `prompts(split)` (a list of `TaskPrompt`) and `verify(prompt,
completion_text) -> dict[str, float]` of reward-term values; the loop renders
prompts with the chat template, samples groups, and scores every sample.

    complete-function   the embedded task: complete a stdlib function's body from its
                        signature and docstring; correct when the function parses
    code-tests          tasks of a file (`--task-file`, `--task-format jsonl|humaneval|mbpp`),
                        scored by running their tests in the sandbox (`code_tests`)
"""
from __future__ import annotations

from typing import Optional

from .code_tests import CodeTestsTask
from .complete_function import CompleteFunctionTask, TaskPrompt

TASKS = {"complete-function": CompleteFunctionTask, "code-tests": CodeTestsTask}


def get_task(name: str, **kwargs):
    if name not in TASKS:
        raise ValueError(f"unknown RL task {name!r}; use one of {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


def build_task(environment, *, task_file: Optional[str] = None):
    """The `--task` of an `EnvironmentConfig` with its settings; `task_file` replaces its --task-file
    (the held-out tasks of --eval-task-file)."""
    if environment.task not in TASKS:
        get_task(environment.task)  # the error listing the names
    return TASKS[environment.task].from_config(environment, task_file=task_file)


__all__ = ["TASKS", "CodeTestsTask", "CompleteFunctionTask", "TaskPrompt", "build_task", "get_task"]
