"""A task's own root filesystem: the sandbox runs its system instead of the host's, and still holds."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from megatron_composer.rl.sandbox import Sandbox, SandboxUnavailable, ensure_available
from megatron_composer.rl.task_envs import sandbox_kwargs_for
from megatron_composer.rl.tasks.coding import prepare_workspace, run_tests
from megatron_composer.rl.tasks.coding.swe import EMBEDDED, load_swe_tasks
from megatron_composer.rl.tasks.task_files import load_code_tasks
from tests.rootfs_builder import MARKER, MARKER_TEXT, build_rootfs
from tests.sandbox_battery import rerun_sandbox_battery



@pytest.fixture(scope="module")
def sandbox_ok():
    try:
        ensure_available()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory, sandbox_ok) -> str:
    return str(build_rootfs(tmp_path_factory.mktemp("rootfs") / "root"))


def test_the_sandbox_runs_the_rootfs_system_not_the_hosts(rootfs, tmp_path):
    assert os.path.exists("/usr/bin/bwrap") and not os.path.exists("/" + MARKER)  # what tells the two apart
    result = Sandbox(tmp_path, rootfs=rootfs).run(
        f"cat /{MARKER}; test -e /usr/bin/bwrap || echo no-bwrap; echo PYTHONPATH=$PYTHONPATH; "
        "test -e /opt/sandbox || echo no-host-site-packages; touch /usr/x 2>/dev/null || echo read-only; "
        "python3 -c 'import pytest; print(pytest.__file__)'; echo made > here.txt")
    assert result.exit_code == 0, result
    assert result.stdout.splitlines() == [MARKER_TEXT.strip(), "no-bwrap", "PYTHONPATH=", "no-host-site-packages",
                                          "read-only", "/usr/lib/python3/dist-packages/pytest/__init__.py"]
    assert (tmp_path / "here.txt").read_text() == "made\n"  # the workspace is the same


def test_hostile_battery_holds_on_a_task_rootfs(rootfs, tmp_path):
    """tests/test_sandbox.py again, every Sandbox running on the rootfs."""
    rerun_sandbox_battery(tmp_path, {"rootfs": rootfs},
                          f"self.rootfs == {rootfs!r} and self.site_packages is None")


def test_a_link_in_the_rootfs_etc_does_not_reach_the_host(rootfs, tmp_path):
    shown = Path(tempfile.mkdtemp(prefix="host-secret-", dir="/tmp"))  # reachable by the sandbox's host uid
    try:
        os.chmod(shown, 0o755)
        secret = shown / "secret"
        secret.write_text("host secret\n")
        os.chmod(secret, 0o644)
        linked = tmp_path / "linked"
        subprocess.run(["cp", "-al", rootfs, str(linked)], check=True)  # hard links: no copy of the data
        (linked / "etc" / "localtime").symlink_to(secret)
        (tmp_path / "ws").mkdir()
        result = Sandbox(tmp_path / "ws", rootfs=str(linked)).run("cat /etc/localtime; echo ran")
    finally:
        shutil.rmtree(shown)
    assert "host secret" not in result.stdout and result.stdout.endswith("ran\n"), result


def test_a_relative_link_in_the_rootfs_etc_that_climbs_out_is_not_followed(rootfs, tmp_path):
    """A `..` link that resolves inside the rootfs on the host climbs elsewhere from where bwrap sees a root
    caller's staged rootfs (/sys/rootfs): the rootfs R = /tmp/B/tmp/Z, its etc/localtime ->
    ../../../tmp/Z/etc/real is R/etc/real here, but /tmp/Z/etc/real (a decoy) from /sys/rootfs/etc. The
    resolved path is what gets bound."""
    outer = Path(os.path.realpath(tempfile.mkdtemp(prefix="rootfs-outer-", dir="/tmp")))
    decoy = Path(os.path.realpath(tempfile.mkdtemp(prefix="rootfs-decoy-", dir="/tmp")))
    try:
        for d in (outer, decoy):
            os.chmod(d, 0o755)
        (decoy / "etc").mkdir(mode=0o755)
        (decoy / "etc" / "real").write_text("a host file\n")
        linked = outer / "tmp" / decoy.name
        linked.parent.mkdir(mode=0o755)
        subprocess.run(["cp", "-al", rootfs, str(linked)], check=True)
        (linked / "etc" / "real").write_text("inside the rootfs\n")
        for f in (decoy / "etc" / "real", linked / "etc" / "real"):
            os.chmod(f, 0o644)
        (linked / "etc" / "localtime").symlink_to(f"../../../tmp/{decoy.name}/etc/real")
        assert os.path.realpath(linked / "etc" / "localtime") == str(linked / "etc" / "real")
        (tmp_path / "ws").mkdir()
        result = Sandbox(tmp_path / "ws", rootfs=str(linked)).run("cat /etc/localtime")
    finally:
        shutil.rmtree(outer)
        shutil.rmtree(decoy)
    assert result.stdout == "inside the rootfs\n", result


def test_a_bad_rootfs_is_refused_naming_it(rootfs, tmp_path):
    (tmp_path / "ws").mkdir()
    with pytest.raises(ValueError, match="no usr/ directory"):
        Sandbox(tmp_path / "ws", rootfs=tmp_path)
    empty = tmp_path / "empty"
    (empty / "usr").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"rootfs='.*empty' cannot run a command in the sandbox .*prlimit"):
        Sandbox(tmp_path / "ws", rootfs=empty)
    with pytest.raises(ValueError, match="site_packages= and rootfs= exclude each other"):
        Sandbox(tmp_path / "ws", rootfs=rootfs, site_packages=str(tmp_path))
    with pytest.raises(ValueError, match="rootfs='/' is the host's own root"):
        Sandbox(tmp_path / "ws", rootfs="/proc/self/root")
    fake = tmp_path / "fake"  # a prlimit that sets nothing: the limits would be off
    subprocess.run(["cp", "-al", rootfs, str(fake)], check=True)
    os.unlink(fake / "usr" / "bin" / "prlimit")
    (fake / "usr" / "bin" / "prlimit").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    os.chmod(fake / "usr" / "bin" / "prlimit", 0o755)
    with pytest.raises(ValueError, match="its prlimit did not set the limits"):
        Sandbox(tmp_path / "ws", rootfs=fake)


def test_task_records_name_a_rootfs_and_are_scored_on_it(rootfs, tmp_path, monkeypatch):
    from megatron_composer.rl.tasks.code_tests import run_code_tests

    monkeypatch.setenv("MC_TASK_ROOTFS_DIR", str(Path(rootfs).parent))  # the operator allows its folder

    tests = (f"def check(candidate):\n    assert candidate() == 2\n"
             f"    assert open('/{MARKER}').read() == {MARKER_TEXT!r}\n")  # passes on the rootfs only
    base = {"prompt": "p", "tests": tests, "entry_point": "f"}
    lines = [dict(base, id="on-rootfs", rootfs=rootfs), dict(base, id="host"),
             dict(base, id="relative", rootfs="root"), dict(base, id="both", rootfs=rootfs, requirements=["attrs"]),
             dict(base, id="host-root", rootfs="/"), dict(base, id="escape", rootfs=f"{rootfs}/../../..")]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    tasks, problems = load_code_tasks(path, "jsonl")
    assert [(t.id, t.rootfs) for t in tasks] == [("on-rootfs", rootfs), ("host", "")]
    said = [p.split(": ", 1)[1].split(";")[0] for p in problems]
    assert said[:3] == [
        "'rootfs' 'root' must be the absolute path of a root filesystem directory, e.g. \"/srv/rootfs/py312\"",
        "'rootfs' and 'requirements' exclude each other: install the packages into the rootfs and drop 'requirements'",
        f"'rootfs' '/' is not inside $MC_TASK_ROOTFS_DIR {str(Path(rootfs).parent)!r}"]
    assert len(said) == 4 and said[3].endswith(f" is not inside $MC_TASK_ROOTFS_DIR {str(Path(rootfs).parent)!r}")
    monkeypatch.delenv("MC_TASK_ROOTFS_DIR")
    _, problems = load_code_tasks(path, "jsonl")
    assert "only inside the directory $MC_TASK_ROOTFS_DIR names" in problems[0]  # not set: no rootfs at all
    program = "def f():\n    return 2\n"
    assert [run_code_tests(t, program, 10.0) for t in tasks] == [(2, 2), (1, 2)]


def test_swe_instance_on_a_rootfs_is_verified_there(rootfs, tmp_path, monkeypatch):
    monkeypatch.setenv("MC_TASK_ROOTFS_DIR", str(Path(rootfs).parent))
    shutil.copytree(EMBEDDED.parent, tmp_path / "swe", ignore=shutil.ignore_patterns("__pycache__"))
    records = [json.loads(line) for line in (tmp_path / "swe" / "tasks.jsonl").read_text().splitlines()][:1]
    (tmp_path / "swe" / "tasks.jsonl").write_text(json.dumps(dict(records[0], rootfs=rootfs)) + "\n")
    (task,), problems = load_swe_tasks(tmp_path / "swe" / "tasks.jsonl")
    assert problems == () and task.rootfs == rootfs and sandbox_kwargs_for(task)["rootfs"] == rootfs
    workspace = tmp_path / "ws"
    prepare_workspace(task, workspace)
    before = run_tests(task, workspace)
    assert (before.fail_to_pass_passed, before.pass_to_pass_passed) == (0, len(task.pass_to_pass))
    from megatron_composer.rl.tasks.coding import apply_solution

    apply_solution(task, workspace)
    assert run_tests(task, workspace).resolved
