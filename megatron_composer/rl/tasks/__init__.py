"""RL tasks: prompts and the verifier that scores a completion.

A task gives `prompts(split)` (a list of `TaskPrompt`) and `verify(prompt,
completion_text) -> dict[str, float]` of reward-term values; the loop renders
prompts with the chat template, samples groups, and scores every sample.

    complete-function   the embedded task: complete a stdlib function's body from its
                        signature and docstring; correct when the function parses
"""
from __future__ import annotations

from .complete_function import CompleteFunctionTask, TaskPrompt

TASKS = {"complete-function": CompleteFunctionTask}


def get_task(name: str, **kwargs):
    if name not in TASKS:
        raise ValueError(f"unknown RL task {name!r}; use one of {', '.join(sorted(TASKS))}")
    return TASKS[name](**kwargs)


__all__ = ["TASKS", "CompleteFunctionTask", "TaskPrompt", "get_task"]
