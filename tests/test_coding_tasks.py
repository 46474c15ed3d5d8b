"""Coding task families: determinism, splits, solutions, workspaces, and the copy filter of verification (no sandbox).

The exhaustive check that every fix-bug and feature-deletion task is solved by
its reference and broken without it runs the pristine tests of all tasks in
one plain subprocess (`RUNNER`: imports each test module and calls its test
functions), not through pytest per task, to stay fast; tests/test_coding_verify.py
runs a sample through the sandboxed `run_tests`.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_composer.rl.tasks.coding import (
    FAMILIES,
    CodingTask,
    Edit,
    apply_solution,
    family_tasks,
    load_tasks,
    prepare_workspace,
    solved_files,
    split_of,
)
from megatron_composer.rl.tasks.coding import feature_deletion
from megatron_composer.rl.tasks.coding.verify import copy_workspace, count_report, expected_test_count

RUNNER = """\
import importlib.util, json, os, sys
failing = {}
for root in sys.argv[1:]:
    os.chdir(root)
    sys.path.insert(0, root)
    for name in [m for m in sys.modules if m.split(".")[0] in os.listdir(root) or m.split(".")[0] + ".py" in os.listdir(root)]:
        del sys.modules[name]
    failing[root] = []
    for test_file in sorted(os.listdir(os.path.join(root, "tests"))):
        spec = importlib.util.spec_from_file_location("t_" + test_file[:-3], os.path.join(root, "tests", test_file))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in [n for n in vars(module) if n.startswith("test")]:
            try:
                getattr(module, name)()
            except BaseException:
                failing[root].append(name)
    sys.path.remove(root)
print(json.dumps(failing))
"""


def failing_tests(workspaces: dict[str, dict[str, str]], tmp_path: Path) -> dict[str, list[str]]:
    """{name: failing test names} for workspaces given as {name: {path: text}}, in one subprocess."""
    roots = {}
    for name, files in workspaces.items():
        root = tmp_path / name
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        roots[str(root)] = name
    out = subprocess.run([sys.executable, "-B", "-c", RUNNER, *roots], capture_output=True, text=True, check=True)
    return {roots[root]: names for root, names in json.loads(out.stdout).items()}


def test_families_are_known_and_unknown_names_are_refused():
    assert list(FAMILIES) == ["write-file", "set-constant", "fix-bug", "feature-deletion", "gather", "swe"]
    with pytest.raises(ValueError, match="unknown coding task family 'nope'; known: write-file, set-constant"):
        load_tasks(["nope"])
    with pytest.raises(ValueError, match="unknown split 'test'"):
        load_tasks(["write-file"], "test")


def test_splits_are_disjoint_deterministic_and_cover_every_family():
    for family in FAMILIES:
        train, evaluation = family_tasks(family, "train"), family_tasks(family, "eval")
        assert train and evaluation, family
        assert not {t.key for t in train} & {t.key for t in evaluation}
        assert all(split_of(t.key) == "train" for t in train) and all(split_of(t.key) == "eval" for t in evaluation)
        assert len({t.key for t in train}) == len(train)
        assert all(t.family == family and t.key.startswith(family + "/") for t in train + evaluation)


def test_load_tasks_is_deterministic_across_processes():
    code = ("from megatron_composer.rl.tasks.coding import load_tasks\n"
            "print([t.key for t in load_tasks(['fix-bug', 'write-file'], 'eval', count=12)])")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert other == str([t.key for t in load_tasks(["fix-bug", "write-file"], "eval", count=12)])


def test_load_tasks_interleaves_families_and_checks_the_count():
    tasks = load_tasks(["set-constant", "fix-bug"], count=6)
    assert [t.family for t in tasks] == ["set-constant", "fix-bug"] * 3
    assert load_tasks(["fix-bug"]) == list(family_tasks("fix-bug", "train"))
    with pytest.raises(ValueError, match=r"10000 eval tasks requested from fix-bug, which hold \d+"):
        load_tasks(["fix-bug"], "eval", count=10_000)


def test_instructions_and_solutions_are_well_formed():
    for family in FAMILIES:
        for task in family_tasks(family, "train")[:50] + family_tasks(family, "eval"):
            assert task.solution and task.tests and task.instruction
            assert all(r in task.files for r in task.reads)
            solved_files(task)  # every search occurs exactly once
    write = family_tasks("write-file", "train")[0]
    assert write.files == {} and write.solution[0].search is None and len(write.instruction) < 100


def test_feature_deletion_solutions_restore_the_code_base_exactly():
    pristine = feature_deletion.codebase_files()
    tasks = family_tasks("feature-deletion", "train") + family_tasks("feature-deletion", "eval")
    assert len(tasks) >= 20
    assert all(p.count("/") <= 1 for p in pristine)  # setup.py's package_data globs: codebase/*.py, codebase/*/*.py
    for task in tasks:
        assert task.files != pristine and solved_files(task) == pristine
        (path,) = {e.path for e in task.solution}
        assert "raise NotImplementedError" in task.files[path] and task.reads == (path,)


def test_reference_passes_and_unsolved_fails_for_every_bug_and_deleted_feature(tmp_path):
    tasks = [t for f in ("fix-bug", "feature-deletion") for t in family_tasks(f, "train") + family_tasks(f, "eval")]
    tasks += [t for f in ("write-file", "set-constant", "gather") for t in family_tasks(f, "eval")[:10]]
    workspaces = {}
    for i, task in enumerate(tasks):
        workspaces[f"{i}-solved"] = {**solved_files(task), **task.tests}
        workspaces[f"{i}-unsolved"] = {**task.files, **task.tests}
    failing = failing_tests(workspaces, tmp_path)
    for i, task in enumerate(tasks):
        assert failing[f"{i}-solved"] == [], task.key
        broken = failing[f"{i}-unsolved"]
        if task.family == "fix-bug":
            assert f"test_{task.key.split('.')[1].split('/')[0]}" in broken, task.key
        elif task.family == "feature-deletion":
            assert any(n.startswith(feature_deletion.feature_test_prefix(task)) for n in broken), task.key
        else:
            assert broken, task.key


def test_prepare_workspace_writes_files_and_removes_planted_caches(tmp_path):
    task = family_tasks("set-constant", "train")[0]
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "config.cpython-311.pyc").write_bytes(b"stale")
    (tmp_path / "config.pyc").write_bytes(b"stale")
    (tmp_path / "tests" / ".pytest_cache").mkdir(parents=True)
    prepare_workspace(task, tmp_path)
    for path, text in task.files.items():
        assert (tmp_path / path).read_text() == text
    assert not list(tmp_path.rglob("*.pyc")) and not list(tmp_path.rglob("*cache*"))


def test_prepare_workspace_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path):
    task = family_tasks("set-constant", "train")[0]
    outside = tmp_path / "outside.txt"
    outside.write_text("host file")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    path = next(p for p in task.files if not p.startswith("tests/"))
    (workspace / path).symlink_to(outside)
    prepare_workspace(task, workspace)
    assert outside.read_text() == "host file" and not (workspace / path).is_symlink()


def test_apply_solution_applies_edits_and_refuses_missing_or_repeated_search_text(tmp_path):
    task = family_tasks("fix-bug", "train")[0]
    prepare_workspace(task, tmp_path)
    apply_solution(task, tmp_path)
    assert {p: (tmp_path / p).read_text() for p in task.files} == solved_files(task)
    with pytest.raises(ValueError, match="occurs 0 times in"):
        apply_solution(task, tmp_path)  # already applied: the buggy line is gone
    repeated = CodingTask("x/y", "x", "", {"a.py": "x = 1\nx = 1\n"}, {}, (Edit("a.py", "x = 1\n", "x = 2\n"),))
    prepare_workspace(repeated, tmp_path / "r")
    with pytest.raises(ValueError, match="occurs 2 times in 'a.py'"):
        apply_solution(repeated, tmp_path / "r")
    missing = CodingTask("x/z", "x", "", {}, {}, (Edit("nope.py", "a", "b"),))
    with pytest.raises(ValueError, match="cannot edit 'nope.py'"):
        apply_solution(missing, tmp_path)
    escaping = CodingTask("x/w", "x", "", {}, {}, (Edit("../evil.py", None, "x"),))
    with pytest.raises(ValueError, match="not a relative path inside the workspace"):
        apply_solution(escaping, tmp_path)


def test_copy_leaves_out_tests_hooks_configuration_caches_shadows_and_links(tmp_path):
    task = family_tasks("fix-bug", "train")[0]
    ws, dest = tmp_path / "ws", tmp_path / "dest"
    prepare_workspace(task, ws)
    planted = ["conftest.py", "tests/conftest.py", "tests/__init__.py", "tests/test_extra.py", "pytest.ini",
               "pyproject.toml", "sub/setup.cfg", "sitecustomize.py", "x.pth", "pytest.py", "json/__init__.py",
               "__pycache__/grid.cpython-311.pyc", "grid.pyc", "native.so"]
    for rel in planted:
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text("raise SystemExit(0)\n")
    (tmp_path / "secret.txt").write_text("host secret")
    (ws / "link.txt").symlink_to(tmp_path / "secret.txt")
    (ws / "linkdir").symlink_to(tmp_path)
    (ws / "big.txt").write_bytes(b"x" * ((1 << 20) + 1))
    os.mkfifo(ws / "pipe")
    notes = copy_workspace(task, ws, dest)
    copied = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert copied == sorted(p for p in task.files if not p.startswith("tests/"))
    for rel in ("conftest.py", "link.txt", "linkdir", "big.txt", "pipe", "pytest.py", "json/__init__.py"):
        assert any(n.startswith(rel + " (") for n in notes), (rel, notes)


def test_copy_keeps_configuration_only_as_the_task_shipped_it(tmp_path):
    task = CodingTask("x/cfg", "x", "", {"pyproject.toml": "[tool.x]\n", "a.py": ""}, {"tests/test_a.py": ""}, ())
    prepare_workspace(task, tmp_path / "ws")
    (tmp_path / "ws" / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = '-p no:python'\n")
    copy_workspace(task, tmp_path / "ws", tmp_path / "dest")
    assert (tmp_path / "dest" / "pyproject.toml").read_text() == "[tool.x]\n"


def test_report_counting_takes_each_tests_worst_outcome():
    xml = b"""<testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_ok"/>
      <testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>
      <testcase classname="tests.test_a" name="test_skip"><skipped message="x"/></testcase>
      <testcase classname="tests.test_a" name="test_twice"><failure message="x"/></testcase>
      <testcase classname="tests.test_a" name="test_twice"><error message="teardown"/></testcase>
    </testsuite></testsuites>"""
    passed, failed, errors, ids = count_report(xml)
    assert (passed, failed, errors, len(ids)) == (1, 2, 1, 4)


def test_expected_test_count_reads_functions_and_test_classes():
    source = "def test_a(): pass\ndef helper(): pass\nclass TestX:\n    def test_b(self): pass\n    def other(self): pass\n"
    assert expected_test_count({"tests/test_m.py": source, "tests/helpers.py": "def test_no(): pass\n"}) == 2
