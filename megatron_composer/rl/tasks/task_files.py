"""Single-turn code tasks read from files (`--task-file`, `--task-format`).

    tasks, problems = load_code_tasks("data/tasks.jsonl", "jsonl")

A path is a JSONL (`.jsonl`, `.json`) or parquet (`.parquet`) file, or a
directory whose files of those kinds are its shards, read in name order.
Every record becomes one `CodeTask`; the formats map their fields so:

    jsonl      {"id": str, "prompt": str, "tests": str, "entry_point": str,
                "setup": str (optional), "timeout_s": float (optional),
                "requirements": [str] (optional), "rootfs": str (optional)}
               the prompt is the user turn as written; requirements are
               PEP 508 strings ("sympy==1.12") installed into a cached
               per-task environment that the sandbox mounts instead of the
               host's site-packages (rl/task_envs.py); rootfs is the
               absolute path of a root filesystem (a directory) whose
               system and python3 the sandbox runs instead of the host's
               (`Sandbox(rootfs=)`); a task names one or the other
    humaneval  task_id -> id; prompt (a signature and docstring) -> shown in a
               ```python fence and run before the completion (`code_prefix`),
               which may be the body alone; test (`def check(candidate)`) ->
               tests; entry_point -> entry_point; canonical_solution -> the
               reference (not used for scoring)
    mbpp       task_id -> id; text (the sanitized split: prompt) plus the
               first of test_list -> the prompt; test_list (assert lines) ->
               tests; test_setup_code and test_imports (sanitized) -> setup;
               code -> the reference; the entry point is the first function
               test_list[0] calls that is not a builtin

Other keys are ignored (data sets carry extra columns). A bad record is
never dropped silently: it becomes a problem `path:line: what is wrong; how
to fix it` in the returned list (the caller reports their count and the
first few), and a file set with no valid record is an error. Lines over
`MAX_LINE_BYTES`, bytes that are not UTF-8, JSON that is not an object,
missing or mistyped fields, tests that do not parse or define no test unit
(`code_harness`), and duplicate ids are problems.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import itertools
import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, TypeVar

from ..task_envs import parse_requirements
from .code_harness import unit_count
from .python_ast import PARSE_LOCK

T = TypeVar("T")

FORMATS = ("jsonl", "humaneval", "mbpp")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
MAX_LINE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class CodeTask:
    id: str
    prompt: str  # the user turn
    tests: str  # Python source (`code_harness` units)
    entry_point: str  # the function the tests call
    setup: str = ""  # run before the program (imports the tests need)
    timeout_s: Optional[float] = None  # the sandbox's wall clock for this task (default: --sandbox-timeout-s)
    code_prefix: str = ""  # code the completion continues (HumanEval's prompt)
    reference: Optional[str] = None  # a known solution, where the format has one
    requirements: tuple[str, ...] = ()  # its own environment's packages (rl/task_envs.py); () = the host's
    rootfs: str = ""  # its own root filesystem (`Sandbox(rootfs=)`); "" = the host's system


class BadRecord(ValueError):
    """A record that is not a task: its message is `problem; fix` (the caller adds `path:line`)."""


def _text(record: dict, key: str, fmt: str, *, optional: bool = False) -> str:
    if key not in record or record[key] is None:
        if optional:
            return ""
        raise BadRecord(f"missing {key!r}; every --task-format {fmt} record needs {', '.join(_REQUIRED[fmt])}")
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(f"{key!r} is {type(value).__name__} {_short(value)}, expected a string; write it as a "
                        "JSON string")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _identifier(value: str, key: str) -> str:
    if not value.isidentifier():
        raise BadRecord(f"{key} {_short(value)} is not a Python identifier; name the function the tests call")
    return value


def _tests(tests: str, key: str) -> str:
    try:
        with PARSE_LOCK:
            count = unit_count(tests)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise BadRecord(f"{key!r} does not parse as Python ({type(exc).__name__}: {exc}); fix the test code")
    if not count:
        raise BadRecord(f"{key!r} has no assert statement or test function to score; add asserts, "
                        "`def check(candidate)` with asserts, or `def test_*()` functions")
    return tests


def _task_id(record: dict, key: str, fmt: str) -> str:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        if value is None:
            raise BadRecord(f"missing {key!r}; every --task-format {fmt} record needs {', '.join(_REQUIRED[fmt])}")
        raise BadRecord(f"{key!r} is {type(value).__name__} {_short(value)}, expected a string or an integer")
    return str(value)


def _timeout(record: dict) -> Optional[float]:
    value = record.get("timeout_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise BadRecord(f"'timeout_s' {_short(value)} must be a positive number of seconds; e.g. 5.0, or "
                        "leave it out for --sandbox-timeout-s")
    return float(value)


def task_requirements(record: dict) -> tuple[str, ...]:
    """The record's validated "requirements" (() without them)."""
    try:
        return parse_requirements(record.get("requirements"))
    except ValueError as exc:
        raise BadRecord(str(exc)) from None


ROOTFS_DIR_VAR = "MC_TASK_ROOTFS_DIR"


def task_rootfs(record: dict) -> str:
    """The record's validated "rootfs", resolved ("" without one): an absolute path to a directory holding usr/,
    inside the directory `$MC_TASK_ROOTFS_DIR` names (the operator's choice of which root filesystems task files
    may run on: as root the sandbox stages a rootfs with root's rights), in a record without "requirements"."""
    value = record.get("rootfs")
    if value is None:
        return ""
    if not isinstance(value, str) or not value.startswith("/"):
        raise BadRecord(f"'rootfs' {_short(value)} must be the absolute path of a root filesystem directory, "
                        "e.g. \"/srv/rootfs/py312\"")
    if record.get("requirements"):
        raise BadRecord("'rootfs' and 'requirements' exclude each other: install the packages into the rootfs "
                        "and drop 'requirements'")
    base = os.environ.get(ROOTFS_DIR_VAR, "")
    if not base.startswith("/"):
        raise BadRecord(f"'rootfs' {_short(value)}: task files may name a root filesystem only inside the directory "
                        f"${ROOTFS_DIR_VAR} names; set it to the absolute path that holds your root filesystems, "
                        "e.g. /srv/rootfs")
    path, base = os.path.realpath(value), os.path.realpath(base)
    if not path.startswith(base.rstrip("/") + "/"):
        raise BadRecord(f"'rootfs' {_short(value)} is not inside ${ROOTFS_DIR_VAR} {base!r}; move it there or "
                        "point the variable at its parent")
    if not os.path.isdir(os.path.join(path, "usr")):
        raise BadRecord(f"'rootfs' {_short(value)} is not a root filesystem (no usr/ directory in it); extract an "
                        "image there, e.g. `docker export $(docker create python:3.12-slim) | tar -x -C DIR`")
    return path


def _from_jsonl(record: dict) -> CodeTask:
    return CodeTask(id=_task_id(record, "id", "jsonl"), prompt=_text(record, "prompt", "jsonl"),
                    tests=_tests(_text(record, "tests", "jsonl"), "tests"),
                    entry_point=_identifier(_text(record, "entry_point", "jsonl"), "entry_point"),
                    setup=_text(record, "setup", "jsonl", optional=True), timeout_s=_timeout(record),
                    requirements=task_requirements(record), rootfs=task_rootfs(record))


def _from_humaneval(record: dict) -> CodeTask:
    prompt = _text(record, "prompt", "humaneval")
    entry = _identifier(_text(record, "entry_point", "humaneval"), "entry_point")
    return CodeTask(id=_task_id(record, "task_id", "humaneval"),
                    prompt=f"Complete the function `{entry}`:\n\n```python\n{prompt.rstrip()}\n```",
                    tests=_tests(_text(record, "test", "humaneval"), "test"), entry_point=entry,
                    code_prefix=prompt, reference=_text(record, "canonical_solution", "humaneval", optional=True))


def _mbpp_entry_point(test: str) -> str:
    try:
        with PARSE_LOCK:
            tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise BadRecord(f"test_list[0] does not parse as Python ({type(exc).__name__}: {exc}); fix the test")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
            return node.func.id
    raise BadRecord("test_list[0] calls no function besides builtins; the first test must call the task's function")


def _from_mbpp(record: dict) -> CodeTask:
    text = _text(record, "text" if "text" in record or "prompt" not in record else "prompt", "mbpp")
    setup = _text(record, "test_setup_code", "mbpp", optional=True)
    imports = record.get("test_imports")  # the sanitized split's list of import lines
    if imports is not None:
        if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
            raise BadRecord(f"'test_imports' is {_short(imports)}, expected a list of import lines")
        setup = "\n".join([setup, *imports]).strip("\n")
    tests = record.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise BadRecord(f"'test_list' is {_short(tests)}, expected a non-empty list of assert strings")
    return CodeTask(id=_task_id(record, "task_id", "mbpp"),
                    prompt=f"{text.strip()}\n\nYour code should pass this test:\n\n```python\n{tests[0].strip()}\n```",
                    tests=_tests("\n".join(tests), "test_list"), entry_point=_mbpp_entry_point(tests[0]),
                    setup=setup, reference=_text(record, "code", "mbpp", optional=True))


_REQUIRED = {"jsonl": ("id", "prompt", "tests", "entry_point"),
             "humaneval": ("task_id", "prompt", "test", "entry_point"),
             "mbpp": ("task_id", "text", "test_list")}
_CONVERT = {"jsonl": _from_jsonl, "humaneval": _from_humaneval, "mbpp": _from_mbpp}


def shard_paths(path: str | Path) -> list[Path]:
    """The files of `path`: itself, or a directory's JSONL and parquet files in name order."""
    path = Path(path)
    if path.is_dir():
        shards = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in JSON_SUFFIXES + PARQUET_SUFFIXES)
        if not shards:
            raise ValueError(f"--task-file {str(path)!r} is a directory without .jsonl, .json or .parquet files; "
                             "point at a file or a directory of shards")
        return shards
    if not path.is_file():
        raise ValueError(f"--task-file {str(path)!r} does not exist; give a .jsonl/.parquet file or a directory")
    if path.suffix not in JSON_SUFFIXES + PARQUET_SUFFIXES:
        raise ValueError(f"--task-file {str(path)!r}: unknown file kind {path.suffix!r}; use .jsonl, .json or "
                         ".parquet")
    return [path]


def _jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    """(location, the record or a BadRecord) of each non-blank line."""
    with open(path, "rb") as f:
        number = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            number += 1
            where = f"{path}:{number}"
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                size = len(line)
                while line and not line.endswith(b"\n"):  # the rest of the line, without holding it
                    line = f.readline(MAX_LINE_BYTES)
                    size += len(line)
                yield where, BadRecord(f"line of {size} bytes is over the {MAX_LINE_BYTES}-byte limit; "
                                       "shorten the task or split its tests")
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRecord(f"not UTF-8 (byte {line[exc.start]:#04x} at column {exc.start + 1}); "
                                       "re-encode the file as UTF-8")
                continue
            if not text.strip():
                continue
            try:
                yield where, json.loads(text)
            except (json.JSONDecodeError, RecursionError) as exc:
                yield where, BadRecord(f"not JSON ({exc}); write one JSON object per line")


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own kinds for a damaged file
        raise ValueError(f"--task-file {str(path)!r} is not a readable parquet file ({exc}); check the file") from exc
    for number, row in enumerate(rows, 1):
        yield f"{path}:row {number}", row


def read_valid(records: Iterable[tuple[str, object]], convert: Callable[[dict, str], T], key: Callable[[T], str], *,
               noun: str = "task", key_name: str = "id") -> tuple[list[T], list[str]]:
    """(`convert(record, where)` of each valid record in order, a `where: problem; fix` for every bad one). Bad:
    a `BadRecord` from the reader or from `convert`, a record that is not an object, a `key` seen before
    (`key_name` names it in the message). Task files and SWE instance files share it."""
    valid, problems, seen = [], [], {}
    for where, record in records:
        try:
            if isinstance(record, BadRecord):
                raise record
            if not isinstance(record, dict):
                raise BadRecord(f"a JSON object is expected, got {type(record).__name__}; write one {noun} per line")
            item = convert(record, where)
            if key(item) in seen:
                raise BadRecord(f"duplicate {key_name} {_short(key(item))} (first at {seen[key(item)]}); give every "
                                f"{noun} its own {key_name}")
        except BadRecord as exc:
            problems.append(f"{where}: {exc}")
            continue
        seen[key(item)] = where
        valid.append(item)
    return valid, problems


def load_code_tasks(path: str | Path, fmt: str = "jsonl") -> tuple[list[CodeTask], list[str]]:
    """(the valid tasks in file order, a `path:line: problem; fix` for every bad record); ValueError when
    no record is valid (module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"--task-format {fmt!r}; use one of {', '.join(FORMATS)}")
    records = itertools.chain.from_iterable(
        _parquet_records(shard) if shard.suffix in PARQUET_SUFFIXES else _jsonl_records(shard)
        for shard in shard_paths(path))  # one id space across the shards
    tasks, problems = read_valid(records, lambda record, _: _CONVERT[fmt](record), lambda t: t.id)
    if not tasks:
        shown = "\n  ".join(problems[:5]) or "(no records)"
        raise ValueError(f"--task-file {str(path)!r} (--task-format {fmt}) has no valid task; {len(problems)} bad "
                         f"record(s), the first:\n  {shown}")
    return tasks, problems
