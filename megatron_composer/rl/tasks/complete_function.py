"""The embedded RL task: write a function's body, verified by Python's own parser.

Prompts are the "complete this function" conversations of the synthetic SFT
set (`data.synthetic_sft`: a stdlib function's signature and docstring, the
held-out split), so a model after `--stage sft` knows the format. The
completion is the code in its ```python fence (up to the closing fence, or
all of it when the fence never closes). Its verdict:

    parses       1.0 when `header + body` parses with `ast` as one function with a
                 statement besides its docstring, else 0.0
    correctness  1.0 when it parses; otherwise partial credit, 0.5 x the fraction of
                 the body's non-empty lines that parse on their own (so a model that
                 cannot yet write a whole function still gets a graded signal)

Scoring runs `ast.parse` in-process (`python_ast.parse_python`, safe from threads): parsing executes nothing.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
from pathlib import Path

from .python_ast import parse_python

_FENCE = "```python\n"


@dataclasses.dataclass(frozen=True)
class TaskPrompt:
    key: str  # module:function, stable across machines
    messages: tuple  # chat messages up to the user turn
    header: str  # the function's signature and docstring


def completion_code(text: str) -> str:
    """The code of a completion: inside its ```python fence when it has one."""
    start = text.find(_FENCE)
    code = text[start + len(_FENCE):] if start >= 0 else text
    end = code.find("```")
    return code[:end] if end >= 0 else code


def parses_with_body(header: str, body: str) -> bool:
    """Whether `header + body` is a function with at least one statement besides its docstring."""
    try:
        tree = parse_python(header.rstrip("\n") + "\n" + body)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(funcs) != 1 or len(tree.body) != 1:
        return False
    statements = funcs[0].body[1:] if ast.get_docstring(funcs[0]) is not None else funcs[0].body
    return bool(statements)


def _statement_parses(line: str) -> bool:
    try:
        parse_python(line.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


class CompleteFunctionTask:
    """Complete-the-function prompts from a stdlib split (deterministic order; the held-out split for evaluation)."""

    name = "complete-function"

    def __init__(self, max_prompt_chars: int = 700, split: str = "train"):
        self.max_prompt_chars, self.split = max_prompt_chars, split
        self._prompts = None

    @classmethod
    def from_config(cls, environment, *, task_file=None) -> "CompleteFunctionTask":
        """The embedded task takes no settings of `EnvironmentConfig` (nor a file)."""
        return cls()

    def prompts(self) -> list[TaskPrompt]:
        if self._prompts is None:
            # Imported here: `...data` pulls in megatron-core and torch, which the light
            # processes that only need the coding tasks of this package never use.
            from ...data.corpus import module_name, stdlib_corpus
            from ...data.synthetic_sft import sft_examples_from_source

            found = []
            for path in stdlib_corpus(self.split):
                try:
                    source = Path(path).read_bytes().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                for key, messages in sft_examples_from_source(source, module_name(Path(path))):
                    user = messages[0]["content"]
                    if key.endswith("__overview__") or len(user) > self.max_prompt_chars:
                        continue
                    header = completion_code(user)
                    found.append(TaskPrompt(key, (messages[0],), header))
            found.sort(key=lambda p: hashlib.sha1(p.key.encode("utf-8")).hexdigest())
            if not found:
                raise ValueError(f"no complete-function prompts found in the stdlib {self.split} split")
            self._prompts = found
        return self._prompts

    def verify(self, prompt: TaskPrompt, completion: str) -> dict[str, float]:
        """{"correctness": graded, "parses": 0 or 1} (module docstring)."""
        code = completion_code(completion)
        if parses_with_body(prompt.header, code):
            return {"correctness": 1.0, "parses": 1.0}
        lines = [line for line in code.split("\n") if line.strip()]
        return {"correctness": 0.5 * sum(map(_statement_parses, lines)) / max(1, len(lines)), "parses": 0.0}
