"""No import cycle in the package: the module graph of `megatron_composer`, read with `ast`.

Every `import` / `from ... import` statement counts, at module level and inside
functions (a function-level import only defers a cycle to the first call).
Relative imports are resolved against the importing module. `from P import n`
is an edge to the submodule `P.n` when it exists, else to the package `P`
(its `__init__`, which re-exports `n`). Imports of anything outside the package
are ignored.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

PACKAGE = "megatron_composer"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package is its __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join([package, *parts])] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of `from {'.' * level}{target} import ...` written in `module`."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]  # a plain module's `.` is its package
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_edges(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                source = _resolve_relative(module, is_package, node.level, node.module)
            else:
                source = node.module or ""
            if source not in modules:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                out.add(submodule if submodule in modules else source)
    out.discard(module)
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = package_modules(root, package)
    return {m: import_edges(m, p, modules) for m, p in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), those of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (BFS)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def describe_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per strongly connected component: a cycle in it, and its other members if any."""
    lines = []
    for component in strongly_connected(graph):
        cycle = one_cycle(graph, component)
        others = sorted(set(component) - set(cycle))
        lines.append(" -> ".join(cycle) + (f"   (same component: {', '.join(others)})" if others else ""))
    return lines


# ---------------------------------------------------------------- the check and its own tests

def test_the_package_has_no_import_cycle():
    cycles = describe_cycles(import_graph())
    assert not cycles, "import cycles in megatron_composer:\n  " + "\n  ".join(cycles)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """A toy package with a cycle through a function-level relative import, a `from . import`
    of a submodule, and an `__init__` re-export: each edge is found, and the cycle is reported."""
    root = _write(tmp_path / "toy", {
        "__init__.py": "from .a import f\n",
        "a.py": "import os\nfrom .sub import b\ndef f():\n    pass\n",
        "sub/__init__.py": "",
        "sub/b.py": "def g():\n    from ..c import h\n    return h\n",
        "c.py": "import toy.sub.b\nfrom . import f\n",
        "d.py": "from .sub.b import g\nimport numpy\n",
    })
    graph = import_graph(root, "toy")
    assert graph == {
        "toy": {"toy.a"},
        "toy.a": {"toy.sub.b"},
        "toy.sub": set(),
        "toy.sub.b": {"toy.c"},
        "toy.c": {"toy.sub.b", "toy"},
        "toy.d": {"toy.sub.b"},
    }
    assert strongly_connected(graph) == [["toy", "toy.a", "toy.c", "toy.sub.b"]]
    assert one_cycle(graph, ["toy", "toy.a", "toy.c", "toy.sub.b"]) == ["toy", "toy.a", "toy.sub.b", "toy.c", "toy"]
    assert one_cycle(graph, ["toy.c", "toy.sub.b"]) == ["toy.c", "toy.sub.b", "toy.c"]


def test_an_acyclic_graph_has_no_component():
    assert strongly_connected({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
