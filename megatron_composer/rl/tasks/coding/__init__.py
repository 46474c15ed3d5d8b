"""Agentic coding tasks: a workspace to edit, pristine tests that verify it.

A model edits a workspace through tools; the task is then verified by
`run_tests`, which runs the task's pristine tests in a sandbox on a filtered
copy of the workspace (`verify.py` lists what is filtered and why). Each
family generates a fixed pool of tasks; `load_tasks` picks a split from it.

    write-file        create one file holding an exact short text (empty workspace, hidden tests)
    set-constant      change a named constant so that its visible test passes
    fix-bug           fix a one-token bug; the instruction names the failing visible test
    feature-deletion  reimplement a function or method of the bundled `minikit` code base
    gather            read k = 3-6 files of one word each, then write their words to answer.txt
                      (k independent reads: the parallel tool-call family)
    swe               resolve an issue in a repository (SWE-bench style instances of
                      --swe-task-file, default the embedded set; `swe.py`)

Splits: a task is in "eval" when the first 8 hex digits of sha1(key) are
0 mod 5 (about 20%), else in "train"; within a split tasks are ordered by
that hash, and several families are interleaved round-robin.

Adding a family: write a module with FAMILY, DESCRIPTION and `generate()`
returning its whole pool of `CodingTask`s (deterministic: seed any randomness
from the key, never from the clock; keys "family/name" unique), register it in
`_GENERATORS`, and keep its files clear of what verification drops (conftest.py
belongs in `tests`, no modules named like the standard library). The
family-wide checks in tests/test_coding_tasks.py then apply to it: the
reference solution passes and the unsolved state does not.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Optional, Sequence

from pathlib import Path

from . import feature_deletion, fix_bug, gather, set_constant, swe, verify, write_file
from .swe import SweTask, SweVerdict, run_swe_tests
from .task import CodingTask, Edit, apply_solution, prepare_workspace, solved_files
from .verify import TestVerdict

_GENERATORS = {m.FAMILY: m for m in (write_file, set_constant, fix_bug, feature_deletion, gather, swe)}
FAMILIES: dict[str, str] = {name: m.DESCRIPTION for name, m in _GENERATORS.items()}
SPLITS = ("train", "eval")
EVAL_MODULUS = 5


def _key_hash(key: str) -> int:
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16)


def split_of(key: str) -> str:
    """"eval" for about one key in EVAL_MODULUS (by sha1 of the key), "train" for the rest."""
    return "eval" if _key_hash(key) % EVAL_MODULUS == 0 else "train"


def run_tests(task: CodingTask, workspace: Path, *, sandbox_kwargs: Optional[dict] = None) -> TestVerdict:
    """The verdict of `task` on `workspace`: `swe.run_swe_tests` for a `SweTask`, else `verify.run_tests`."""
    if isinstance(task, SweTask):
        return run_swe_tests(task, workspace, sandbox_kwargs=sandbox_kwargs)
    return verify.run_tests(task, workspace, sandbox_kwargs=sandbox_kwargs)


@functools.lru_cache(maxsize=None)
def family_tasks(family: str, split: str, swe_task_file: Optional[str] = None) -> tuple[CodingTask, ...]:
    """The tasks of one family in one split, ordered by the hash of their keys (the swe family reads
    `swe_task_file`, default its embedded set)."""
    if family not in _GENERATORS:
        raise ValueError(f"unknown coding task family {family!r}; known: {', '.join(FAMILIES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    pool = swe.generate(swe_task_file) if family == swe.FAMILY else _GENERATORS[family].generate()
    return tuple(sorted((t for t in pool if split_of(t.key) == split), key=lambda t: (_key_hash(t.key), t.key)))


def load_tasks(families: Sequence[str], split: str = "train", *, count: Optional[int] = None,
               swe_task_file: Optional[str] = None) -> list[CodingTask]:
    """The tasks of `families` in `split`, interleaved round-robin in the order given; the first `count` of them
    (the swe family's from `swe_task_file`, default its embedded set).

    ValueError when `count` is more than the families hold in that split.
    """
    if isinstance(families, str):
        families = [families]
    per_family = [family_tasks(f, split, swe_task_file if f == swe.FAMILY else None)
                  for f in dict.fromkeys(families)]
    if not per_family:
        raise ValueError(f"no coding task family given; known: {', '.join(FAMILIES)}")
    longest = max(len(tasks) for tasks in per_family)
    mixed = [tasks[i] for i in range(longest) for tasks in per_family if i < len(tasks)]
    if count is None:
        return mixed
    if count > len(mixed):
        raise ValueError(f"{count} {split} tasks requested from {', '.join(families)}, which hold {len(mixed)}; "
                         f"lower the count or add families")
    return mixed[:count]


__all__ = ["FAMILIES", "SPLITS", "CodingTask", "Edit", "SweTask", "SweVerdict", "TestVerdict", "apply_solution", "family_tasks",
           "load_tasks", "prepare_workspace", "run_tests", "solved_files", "split_of"]
