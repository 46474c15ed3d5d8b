"""Coding task verification end to end: `run_tests` runs pytest in the sandbox (bubblewrap) on sampled tasks,
and each reward-hacking defense of `verify.py` is attacked once."""
import os
import textwrap

import pytest

from megatron_composer.rl.sandbox import Sandbox
from megatron_composer.rl.tasks.coding import (
    FAMILIES,
    apply_solution,
    family_tasks,
    load_tasks,
    prepare_workspace,
    run_tests,
    solved_files,
)


@pytest.fixture
def constant_task():
    """A set-constant task (three visible tests, a one-line solution) whose old and new values have equal length."""
    return next(t for t in family_tasks("set-constant", "train")
                if len(t.files[t.solution[0].path]) == len(solved_files(t)[t.solution[0].path]))


def unsolved(task, tmp_path, name="ws"):
    workspace = tmp_path / name
    prepare_workspace(task, workspace)
    return workspace


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_passes_and_unsolved_state_fails(family, tmp_path):
    for i, task in enumerate(load_tasks([family], "eval", count=2)):
        workspace = unsolved(task, tmp_path, f"ws{i}")
        before = run_tests(task, workspace)
        assert not before.all_pass and before.fraction < 1 and not before.timed_out, (task.key, before.output)
        apply_solution(task, workspace)
        after = run_tests(task, workspace)
        assert after.all_pass and after.fraction == 1.0 and after.total == before.total, (task.key, after.output)
        assert after.passed == after.total and after.failed == after.errors == 0


def test_verdict_counts_the_visible_tests(constant_task, tmp_path):
    verdict = run_tests(constant_task, unsolved(constant_task, tmp_path))
    assert (verdict.passed, verdict.failed, verdict.errors, verdict.total) == (1, 2, 0, 3)
    assert verdict.fraction == pytest.approx(1 / 3) and "2 failed, 1 passed" in verdict.output


def test_editing_or_deleting_the_tests_does_not_change_the_verdict(constant_task, tmp_path):
    workspace = unsolved(constant_task, tmp_path)
    reference = run_tests(constant_task, workspace)
    (test_path,) = constant_task.tests
    (workspace / test_path).write_text("def test_anything():\n    pass\n")
    (workspace / "tests" / "test_more.py").write_text("def test_more():\n    pass\n")
    edited = run_tests(constant_task, workspace)
    (workspace / test_path).unlink()
    deleted = run_tests(constant_task, workspace)
    for verdict in (edited, deleted):
        assert (verdict.passed, verdict.failed, verdict.total) == (reference.passed, reference.failed, reference.total)


def test_a_file_where_the_tests_directory_was_does_not_break_verification(constant_task, tmp_path):
    workspace = unsolved(constant_task, tmp_path)
    apply_solution(constant_task, workspace)
    for path in (workspace / "tests").iterdir():
        path.unlink()
    (workspace / "tests").rmdir()
    (workspace / "tests").write_text("not a directory\n")
    assert run_tests(constant_task, workspace).all_pass


def test_a_planted_conftest_that_forces_passes_has_no_effect(constant_task, tmp_path):
    workspace = unsolved(constant_task, tmp_path)
    force = textwrap.dedent("""\
        import pytest

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(item, call):
            outcome = yield
            report = outcome.get_result()
            report.outcome, report.longrepr = "passed", None
        """)
    (workspace / "conftest.py").write_text(force)
    (workspace / "tests" / "conftest.py").write_text(force)
    direct = Sandbox(workspace).run("python3 -m pytest -q -p no:cacheprovider tests")
    assert direct.exit_code == 0  # sanity: without the defenses the plant works
    assert run_tests(constant_task, workspace).passed == 1
    (workspace / "pytest.ini").write_text("[pytest]\naddopts = -p no:python\n")
    (workspace / "sitecustomize.py").write_text("import os\nos._exit(0)\n")
    assert run_tests(constant_task, workspace).passed == 1


def test_a_planted_pyc_of_the_solution_is_removed_and_ignored(constant_task, tmp_path):
    """A .pyc compiled from the solution, next to a wrong .py of the same size and mtime, is what Python imports."""
    workspace = unsolved(constant_task, tmp_path)
    (module,) = {e.path for e in constant_task.solution}
    wrong, right = constant_task.files[module], solved_files(constant_task)[module]
    assert len(wrong) == len(right)  # the pyc's size check cannot tell them apart
    stat = os.stat(workspace / module)
    (workspace / module).write_text(right)
    os.utime(workspace / module, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    plant = f"import py_compile; py_compile.compile({module!r}, doraise=True); py_compile.compile({module!r}, cfile={module + 'c'!r}, doraise=True)"
    assert Sandbox(workspace).run(["python3", "-c", plant]).exit_code == 0
    (workspace / module).write_text(wrong)
    os.utime(workspace / module, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    direct = Sandbox(workspace).run("python3 -m pytest -q -p no:cacheprovider tests")
    assert direct.exit_code == 0  # sanity: the stale pyc makes the wrong source pass
    assert not run_tests(constant_task, workspace).all_pass
    prepare_workspace(constant_task, workspace)
    assert not list(workspace.rglob("*.pyc"))


def test_a_symlink_to_a_host_file_is_not_followed(constant_task, tmp_path):
    workspace = unsolved(constant_task, tmp_path)
    (module,) = {e.path for e in constant_task.solution}
    host_file = tmp_path / "host_solution.py"
    host_file.write_text(solved_files(constant_task)[module])
    (workspace / module).unlink()
    (workspace / module).symlink_to(host_file)
    verdict = run_tests(constant_task, workspace)
    assert not verdict.all_pass and f"{module} (a symlink)" in verdict.output


def test_shadowing_pytest_from_the_workspace_has_no_effect(constant_task, tmp_path):
    workspace = unsolved(constant_task, tmp_path)
    (workspace / "pytest.py").write_text("raise SystemExit(0)\n")
    (workspace / "xml").mkdir()
    (workspace / "xml" / "__init__.py").write_text("raise SystemExit(0)\n")
    assert Sandbox(workspace).run("python3 -m pytest -q tests").exit_code == 0  # sanity: the shadow works
    assert not run_tests(constant_task, workspace).all_pass


def solved_then_appended(task, tmp_path, code: str):
    """A workspace with the reference solution, then `code` appended to its edited module."""
    workspace = unsolved(task, tmp_path)
    apply_solution(task, workspace)
    (module,) = {e.path for e in task.solution}
    with open(workspace / module, "a") as f:
        f.write(code)
    return workspace


def test_code_that_exits_before_the_report_scores_nothing(constant_task, tmp_path):
    workspace = solved_then_appended(constant_task, tmp_path, "\nimport os\nos._exit(0)\n")
    verdict = run_tests(constant_task, workspace)
    assert (verdict.passed, verdict.errors, verdict.total) == (0, 3, 3) and not verdict.all_pass


def test_a_timed_out_run_scores_zero(constant_task, tmp_path):
    workspace = solved_then_appended(constant_task, tmp_path, "\nwhile True:\n    pass\n")
    verdict = run_tests(constant_task, workspace, sandbox_kwargs={"timeout_s": 2.0})
    assert verdict.timed_out and verdict.fraction == 0.0 and not verdict.all_pass
