"""Verification: run a task's pristine tests on the model's workspace, in a sandbox.

The workflow of `run_tests`:

  1. make a fresh verification directory (a tempdir, removed afterwards);
  2. copy the workspace into it, leaving out what could change the verdict
     without changing the code under test (`copy_plan`):
       - the task's test files, and everything under its test directories
         (they are rewritten from the pristine copy in step 3);
       - every `conftest.py` (a pristine one comes back in step 3);
       - pytest and Python configuration: `pytest.ini`, `.pytest.ini`,
         `tox.ini`, `setup.cfg`, `pyproject.toml` come only from the task's
         original files, never from the workspace; `sitecustomize.py`,
         `usercustomize.py`, `*.pth` never;
       - caches (`__pycache__`, `.pytest_cache`, ...), compiled files
         (`*.pyc`, `*.pyo`) and native modules (`*.so`, `*.pyd`), which Python
         would import in place of the `.py` next to them;
       - top-level modules or packages named like a standard-library module or
         like pytest and its dependencies (they would shadow them);
       - symlinks (never followed: their target may be outside the workspace)
         and anything that is not a regular file;
       - files over MAX_FILE_BYTES, and everything once MAX_COPY_BYTES or
         MAX_COPY_FILES have been copied;
  3. write the pristine tests;
  4. run pytest on the test files in a `Sandbox` (the directory is its
     /workspace) from a launcher that drops the working directory from
     `sys.path` until pytest and its plugins are imported;
  5. count the verdict from a JUnit XML report written under a fresh random
     name. Tests the pristine files define (by `ast`) but the report lacks
     count as errors; a skipped test counts as failed; a run that exits
     non-zero with nothing failed gets one error; a timed-out run passes
     nothing.

Limits: the code under test runs inside pytest's process, so code written to
tamper with pytest itself (patching its reports, rewriting the report file)
is not stopped here; the defenses close the routes that need no such code.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import secrets
import shutil
import stat
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath
from typing import Mapping, Optional

from ...sandbox import Sandbox
from ..python_ast import parse_python
from .task import CACHE_DIRS, CACHE_SUFFIXES, CodingTask, workspace_path

MAX_FILE_BYTES = 1 << 20  # a larger workspace file is not copied (the model sees a note)
MAX_COPY_BYTES = 32 << 20
MAX_COPY_FILES = 5000
MAX_REPORT_BYTES = 8 << 20
OUTPUT_CHARS = 6000  # the tail of pytest's output kept in the verdict

CONFIG_NAMES = frozenset({"pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})
HOOK_NAMES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py"})  # run by pytest or Python on their own
SKIPPED_SUFFIXES = CACHE_SUFFIXES + (".pth", ".so", ".pyd")
SHADOWED = frozenset(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging"}

# sys.path[0] is the working directory under `python3 -c`: drop it so nothing in
# the workspace shadows pytest or the modules it imports; the workspace root
# comes back once the session starts (the tests import the code under test).
LAUNCHER = """\
import sys
del sys.path[0]
import os
import pytest


class WorkspaceOnPath:
    def pytest_sessionstart(self, session):
        sys.path.insert(0, os.getcwd())


raise SystemExit(pytest.main(sys.argv[1:], plugins=[WorkspaceOnPath()]))
"""


@dataclasses.dataclass(frozen=True)
class TestVerdict:
    __test__ = False  # not a pytest test class

    passed: int
    failed: int  # failed or skipped
    errors: int  # errored, or defined by the pristine tests but never reported
    total: int
    output: str  # the runner's output (its tail), shown to the model by run_tests
    timed_out: bool

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_pass(self) -> bool:
        return self.total > 0 and self.passed == self.total


def _is_test_file(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def expected_test_count(tests: Mapping[str, str]) -> int:
    """How many tests the pristine files define: `test*` functions, and `test*` methods of `Test*` classes."""
    count = 0
    for path, text in tests.items():
        if not _is_test_file(PurePosixPath(path).name):
            continue
        for node in parse_python(text, path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                count += 1
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                count += sum(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")
                             for m in node.body)
    return count


def _skip_reason(task: CodingTask, rel: str, test_dirs: frozenset[str]) -> Optional[str]:
    """Why the workspace file `rel` is not copied into verification, or None to copy it."""
    path = PurePosixPath(rel)
    if rel in task.tests or any(rel.startswith(d + "/") for d in test_dirs):
        return "test"
    if "." in test_dirs and len(path.parts) == 1 and _is_test_file(path.name):
        return "test"
    if path.name in HOOK_NAMES or path.name in CONFIG_NAMES:
        return "changes how pytest or Python start"
    if path.name.endswith(SKIPPED_SUFFIXES):
        return "compiled, native or .pth file"
    top = path.parts[0]
    module = top[:-3] if len(path.parts) == 1 and top.endswith(".py") else top
    if module in SHADOWED and (len(path.parts) > 1 or top.endswith(".py")):
        return f"shadows the module {module!r}"
    return None


def _read_regular(path: str, limit: int) -> Optional[bytes]:
    """The bytes of a regular file that is not a symlink (opened without following links), None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit + 1)


def copy_workspace(task: CodingTask, workspace: Path, dest: Path) -> list[str]:
    """Copy what verification may see of `workspace` into `dest` (module docstring, step 2); notes on what was left out."""
    test_dirs = frozenset(str(PurePosixPath(p).parent) for p in task.tests)
    notes, copied_bytes, copied_files = [], 0, 0
    for dirpath, dirnames, filenames in os.walk(workspace):  # never descends into linked directories
        rel_dir = os.path.relpath(dirpath, workspace)
        for name in sorted(dirnames):
            if name in CACHE_DIRS:
                dirnames.remove(name)
            elif os.path.islink(os.path.join(dirpath, name)):
                dirnames.remove(name)
                notes.append(f"{os.path.normpath(os.path.join(rel_dir, name))} (a symlink)")
        for name in sorted(filenames):
            rel = PurePosixPath(os.path.normpath(os.path.join(rel_dir, name))).as_posix()
            reason = _skip_reason(task, rel, test_dirs)
            if reason == "test":  # rewritten from the pristine tests
                continue
            if reason is None and os.path.islink(os.path.join(dirpath, name)):
                reason = "a symlink"
            if reason is None and copied_files >= MAX_COPY_FILES:
                reason = f"more than {MAX_COPY_FILES} files"
            data = None if reason else _read_regular(os.path.join(dirpath, name), MAX_FILE_BYTES)
            if reason is None and data is None:
                reason = "not a regular file"
            elif data is not None and len(data) > MAX_FILE_BYTES:
                reason = f"over {MAX_FILE_BYTES} bytes"
            elif data is not None and copied_bytes + len(data) > MAX_COPY_BYTES:
                reason = f"over {MAX_COPY_BYTES} bytes copied in all"
            if reason:
                notes.append(f"{rel} ({reason})")
                continue
            target = workspace_path(dest, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            copied_bytes, copied_files = copied_bytes + len(data), copied_files + 1
    for rel in sorted(task.files):
        if PurePosixPath(rel).name in CONFIG_NAMES:  # configuration only as the task shipped it
            write_over(dest, rel, task.files[rel])
    return notes


def write_over(root: Path, rel: str, text: str) -> None:
    """Write a pristine file at `root / rel`, removing whatever copied file or directory stands in its way."""
    target = workspace_path(root, rel)
    for parent in reversed(target.parents):
        if parent.is_relative_to(root) and parent != root and parent.exists() and not parent.is_dir():
            parent.unlink()
    if target.is_dir():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")


def count_report(xml_bytes: bytes) -> tuple[int, int, int, set[str]]:
    """(passed, failed, errors, test ids) from a JUnit XML report; a test with several entries takes its worst."""
    worst: dict[str, int] = {}  # 0 passed, 1 failed or skipped, 2 error
    for case in ET.fromstring(xml_bytes).iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        outcome = 2 if "error" in kinds else 1 if kinds & {"failure", "skipped"} else 0
        worst[test_id] = max(worst.get(test_id, 0), outcome)
    values = list(worst.values())
    return values.count(0), values.count(1), values.count(2), set(worst)


def _tail(text: str, limit: int = OUTPUT_CHARS) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


def run_tests(task: CodingTask, workspace: Path, *, sandbox_kwargs: Optional[dict] = None) -> TestVerdict:
    """Run `task.tests` against `workspace` in a fresh sandboxed copy and count the results (module docstring)."""
    expected = expected_test_count(task.tests)
    kwargs = {"timeout_s": task.test_timeout_s, **(sandbox_kwargs or {})}
    root = Path(tempfile.mkdtemp(prefix="coding-verify-"))
    try:
        notes = copy_workspace(task, Path(workspace), root)
        for rel, text in task.tests.items():
            write_over(root, rel, text)
        report = f".report-{secrets.token_hex(8)}.xml"
        test_files = sorted(p for p in task.tests if _is_test_file(PurePosixPath(p).name))
        cmd = ["python3", "-c", LAUNCHER, "-q", "-p", "no:cacheprovider", "--tb=short",
               f"--junitxml={report}", *test_files]
        result = Sandbox(root, **kwargs).run(cmd)
        output = result.stdout + (("\n" + result.stderr) if result.stderr.strip() else "")
        if notes:
            output = "not copied for verification: " + ", ".join(notes[:10]) + ("" if len(notes) <= 10 else ", ...") + "\n" + output
        if result.timed_out:
            return TestVerdict(0, 0, max(expected, 1), max(expected, 1), _tail(output + "\n[timed out]"), True)
        data = _read_regular(str(root / report), MAX_REPORT_BYTES)
        try:
            passed, failed, errors, ids = count_report(data) if data and len(data) <= MAX_REPORT_BYTES else (0, 0, 0, set())
        except ET.ParseError:
            passed, failed, errors, ids = 0, 0, 0, set()
        errors += max(0, expected - len(ids))  # defined but never reported
        if result.exit_code != 0 and failed + errors == 0:
            errors += 1  # e.g. the session failed after the tests ran
        return TestVerdict(passed, failed, errors, passed + failed + errors, _tail(output), False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
