"""A coding task, its reference solution, and the workspace it starts from.

A `CodingTask` is data: the files the model starts with, the pristine tests
that verify it, and a reference solution as a list of `Edit`s (what a scripted
expert trajectory applies through the edit tools). Paths are relative to the
workspace and may not leave it (no absolute paths, no `..`).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Mapping, Optional

# Directories and file suffixes that are caches: never part of a workspace we
# hand out, never copied into verification (a planted .pyc of a correct
# solution would otherwise be imported in place of a wrong .py).
CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", ".tox", ".nox"})
CACHE_SUFFIXES = (".pyc", ".pyo")


@dataclasses.dataclass(frozen=True)
class Edit:
    """One step of a reference solution: replace `search` (exactly once) by `replace`, or write the whole file."""

    path: str  # relative to the workspace
    search: Optional[str]  # exact text to replace (must occur exactly once); None: write the whole file
    replace: str


@dataclasses.dataclass(frozen=True)
class CodingTask:
    key: str  # "family/name", stable across machines
    family: str
    instruction: str  # the user's request to the model (names the files/functions involved)
    files: Mapping[str, str]  # the starting workspace (visible tests included when the family shows them)
    tests: Mapping[str, str]  # the pristine tests: what verification runs
    solution: tuple[Edit, ...]  # the reference solution, applied in order
    reads: tuple[str, ...] = ()  # files an expert reads before editing (scripted trajectories)
    test_timeout_s: float = 20.0


def workspace_path(workspace: Path, path: str) -> Path:
    """`workspace / path` for a relative path that stays inside the workspace; ValueError otherwise."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts or "\\" in path:
        raise ValueError(f"path {path!r} is not a relative path inside the workspace (no leading '/', no '..')")
    return Path(workspace).joinpath(*parts)


def write_text(workspace: Path, path: str, text: str) -> None:
    """Write `text` to a workspace file, replacing a symlink there instead of writing through it."""
    target = workspace_path(workspace, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink():
        target.unlink()
    target.write_text(text, encoding="utf-8")


def remove_caches(root: Path) -> None:
    """Delete cache directories and compiled files under `root` (links are not followed)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in list(dirnames):
            if name in CACHE_DIRS:
                full = os.path.join(dirpath, name)
                if os.path.islink(full):
                    os.unlink(full)
                else:
                    shutil.rmtree(full)
                dirnames.remove(name)
        for name in filenames:
            if name.endswith(CACHE_SUFFIXES):
                os.unlink(os.path.join(dirpath, name))


def prepare_workspace(task: CodingTask, workspace: Path) -> None:
    """Write `task.files` into `workspace` (created when missing) and remove any caches in it."""
    workspace = Path(workspace)
    if workspace.exists() and not workspace.is_dir():
        raise ValueError(f"workspace {workspace} exists and is not a directory")
    workspace.mkdir(parents=True, exist_ok=True)
    for path, text in task.files.items():
        write_text(workspace, path, text)
    remove_caches(workspace)


def apply_edit(workspace: Path, edit: Edit) -> None:
    """Apply one `Edit`; ValueError when its search text is not in the file exactly once."""
    if edit.search is None:
        write_text(workspace, edit.path, edit.replace)
        return
    target = workspace_path(workspace, edit.path)
    if target.is_symlink() or not target.is_file():
        raise ValueError(f"cannot edit {edit.path!r}: it is not a regular file in the workspace")
    text = target.read_text(encoding="utf-8")
    found = text.count(edit.search)
    if found != 1:
        shown = edit.search if len(edit.search) <= 80 else edit.search[:77] + "..."
        raise ValueError(f"search text {shown!r} occurs {found} times in {edit.path!r}; an edit needs exactly one")
    target.write_text(text.replace(edit.search, edit.replace), encoding="utf-8")


def apply_solution(task: CodingTask, workspace: Path) -> None:
    """Apply `task.solution` to a prepared workspace, in order."""
    for edit in task.solution:
        apply_edit(Path(workspace), edit)


def solved_files(task: CodingTask) -> dict[str, str]:
    """`task.files` with the reference solution applied, computed in memory (no workspace)."""
    files = dict(task.files)
    for edit in task.solution:
        if edit.search is None:
            files[edit.path] = edit.replace
            continue
        text = files.get(edit.path)
        found = 0 if text is None else text.count(edit.search)
        if found != 1:
            raise ValueError(f"{task.key}: a search text occurs {found} times in {edit.path!r}; an edit needs exactly one")
        files[edit.path] = text.replace(edit.search, edit.replace)
    return files


def is_regular_file(path: str) -> bool:
    """Whether `path` is a regular file itself (a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
