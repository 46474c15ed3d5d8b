"""feature-deletion: reimplement one function or method of a small code base.

The code base is `codebase/` next to this file (package data): a package
`minikit` and its unit tests under `tests/`, where the tests of a function
`name` are named `test_<name>*` and those of a method `Class.name`
`test_<class>_<name>*`. A task replaces ONE body by `raise NotImplementedError`
(signature and docstring kept, located with `ast` line numbers) and asks for
it back; the whole suite verifies it. Dunder methods are never removed.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from ..python_ast import parse_python
from .task import CodingTask, Edit

FAMILY = "feature-deletion"
DESCRIPTION = "reimplement a function or method of the bundled minikit code base (body removed, docstring kept)"
CODEBASE = Path(__file__).with_name("codebase")
STUB = "raise NotImplementedError"


@functools.lru_cache(maxsize=1)
def codebase_files() -> dict[str, str]:
    """The code base as {relative path: text}, sorted by path."""
    files = {p.relative_to(CODEBASE).as_posix(): p.read_text(encoding="utf-8")
             for p in CODEBASE.rglob("*.py") if "__pycache__" not in p.parts}
    if not files:
        raise ValueError(f"the feature-deletion code base is missing from {CODEBASE} (is the package data installed?)")
    return dict(sorted(files.items()))


def features(source: str) -> list[tuple[str, ast.FunctionDef]]:
    """(qualified name, node) of each module-level function and non-dunder method, in source order."""
    found = []
    for node in parse_python(source).body:
        if isinstance(node, ast.FunctionDef):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            found += [(f"{node.name}.{m.name}", m) for m in node.body
                      if isinstance(m, ast.FunctionDef) and not m.name.startswith("__")]
    return found


def remove_body(source: str, node: ast.FunctionDef) -> tuple[str, Edit]:
    """`source` with `node`'s body after its docstring replaced by the stub, and the Edit that restores it."""
    if ast.get_docstring(node) is None:
        raise ValueError(f"feature {node.name!r} at line {node.lineno} has no docstring to keep")
    lines = source.splitlines(keepends=True)
    first, last = node.body[1].lineno - 1, node.end_lineno  # 0-based start, exclusive end
    indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
    stub = f"{indent}{STUB}\n"
    stubbed = "".join(lines[:first]) + stub + "".join(lines[last:])
    if stubbed.count(stub) != 1:
        raise ValueError(f"the stub line {stub!r} is not unique after removing {node.name!r}")
    return stubbed, Edit("", stub, "".join(lines[first:last]))


def _test_file(module_path: str) -> str:
    return f"tests/test_{Path(module_path).stem}.py"


def generate() -> list[CodingTask]:
    """One task per removable feature of the code base."""
    files = codebase_files()
    tests = {p: t for p, t in files.items() if p.startswith("tests/")}
    tasks = []
    for path, source in files.items():
        if not path.startswith("minikit/") or path.endswith("__init__.py"):
            continue
        module = path[:-3].replace("/", ".")
        for name, node in features(source):
            if len(node.body) < 2:
                continue  # a docstring alone: nothing to remove
            stubbed, edit = remove_body(source, node)
            kind = "method" if "." in name else "function"
            instruction = (f"The {kind} `{name}` in {path} is not implemented (it raises NotImplementedError). "
                           f"Implement it as its docstring describes; {_test_file(path)} tests it.")
            tasks.append(CodingTask(
                key=f"{FAMILY}/{module}.{name}", family=FAMILY, instruction=instruction,
                files={**files, path: stubbed}, tests=tests,
                solution=(Edit(path, edit.search, edit.replace),), reads=(path,)))
    return tasks


def feature_test_prefix(task: CodingTask) -> str:
    """The prefix of the test names that test the removed feature: `test_<name>` or `test_<class>_<name>`."""
    name = task.key.split("/", 1)[1].split(".", 2)[2]
    return "test_" + name.replace(".", "_").lower() if "." in name else f"test_{name}"
