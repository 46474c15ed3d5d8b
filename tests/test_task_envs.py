"""Per-task environments (rl/task_envs.py) built offline from a local wheelhouse, mounted by the sandbox."""
import base64
import hashlib
import importlib.metadata
import json
import zipfile
from pathlib import Path

import pytest

from megatron_composer.rl import task_envs
from megatron_composer.rl.sandbox import Sandbox, SandboxUnavailable, ensure_available
from megatron_composer.rl.task_envs import TaskEnvError, parse_requirements, task_env_site_packages
from megatron_composer.rl.tasks.task_files import load_code_tasks
from tests.sandbox_battery import rerun_sandbox_battery

PYTEST_CLOSURE = ("pytest", "iniconfig", "pluggy", "packaging", "pygments")  # pytest's deps on Linux, 3.11+


def _wheel_from_installed(dist_name: str, out: Path) -> None:
    """A wheel of an installed distribution (its RECORD's files), so pip can install it without an index."""
    dist = importlib.metadata.distribution(dist_name)
    name = dist.metadata["Name"].replace("-", "_")
    path = out / f"{name}-{dist.version}-py3-none-any.whl"
    base = Path(dist.locate_file(""))
    records = []
    with zipfile.ZipFile(path, "w") as whl:
        for file in dist.files:
            rel = str(file)
            if "__pycache__" in rel or rel.startswith("..") or rel.endswith("RECORD") or rel.endswith("INSTALLER"):
                continue
            data = (base / rel).read_bytes()
            whl.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{rel},sha256={digest},{len(data)}")
        record = next(str(f) for f in dist.files if str(f).endswith(".dist-info/METADATA")).replace("METADATA",
                                                                                                    "RECORD")
        whl.writestr(record, "\n".join(records + [f"{record},,"]) + "\n")


def _tiny_wheel(out: Path, name: str, version: str, body: str) -> None:
    dist_info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": body,
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(out / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for rel, text in files.items():
            whl.writestr(rel, text)
        whl.writestr(f"{dist_info}/RECORD", "".join(f"{rel},,\n" for rel in files) + f"{dist_info}/RECORD,,\n")


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheelhouse")
    for dist in PYTEST_CLOSURE:
        _wheel_from_installed(dist, out)
    _tiny_wheel(out, "mc_taskdep", "1.2.0", "VALUE = 'from the task env'\n")
    return out


@pytest.fixture(scope="module")
def env_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("task-envs")


@pytest.fixture(scope="module")
def task_site(wheelhouse, env_cache):
    return task_env_site_packages(["mc_taskdep==1.2.0"], pip_args=["--no-index", "--find-links", str(wheelhouse)],
                                  cache=env_cache)


@pytest.fixture(scope="module")
def sandbox_ok():
    try:
        ensure_available()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


def test_task_requirement_imports_in_the_sandbox_and_host_packages_do_not(task_site, sandbox_ok, tmp_path):
    importlib.metadata.distribution("numpy")  # host-only: in this venv, not in the task's environment
    code = ("import mc_taskdep, pytest; print(mc_taskdep.VALUE)\n"
            "try:\n    import numpy\nexcept ImportError:\n    print('no numpy')\n")
    result = Sandbox(tmp_path, site_packages=task_site, timeout_s=30).run(["python3", "-c", code])
    assert (result.exit_code, result.stdout) == (0, "from the task env\nno numpy\n"), result.stderr
    host = Sandbox(tmp_path, timeout_s=30).run(["python3", "-c", "import numpy; import mc_taskdep"])
    assert host.exit_code == 1 and "No module named 'mc_taskdep'" in host.stderr  # host mount: numpy, no task dep


def test_cache_is_reused_and_keyed_by_requirements(task_site, wheelhouse, env_cache, monkeypatch):
    args = ["--no-index", "--find-links", str(wheelhouse)]
    env_root = Path(task_site).parents[2]
    assert (env_root / task_envs.STAMP).is_file()
    monkeypatch.setattr(task_envs, "_build", lambda *a: pytest.fail("rebuilt a cached environment"))
    assert task_env_site_packages(["mc_taskdep==1.2.0"], pip_args=args, cache=env_cache) == task_site
    monkeypatch.setenv("MC_TASK_ENV_CACHE", str(env_cache))
    monkeypatch.setenv("MC_TASK_ENV_PIP_ARGS", " ".join(args))
    assert task_env_site_packages(["mc_taskdep == 1.2.0"]) == task_site  # env vars; normalised spelling
    with pytest.raises(pytest.fail.Exception, match="rebuilt"):
        task_env_site_packages(["mc_taskdep>=1"], pip_args=args, cache=env_cache)


def test_failed_install_names_the_requirement_and_leaves_nothing(wheelhouse, tmp_path):
    with pytest.raises(TaskEnvError, match=r"(?s)mc-missing-pkg==9.*No matching distribution"):
        task_env_site_packages(["mc-missing-pkg==9"], pip_args=["--no-index", "--find-links", str(wheelhouse)],
                               cache=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []


@pytest.mark.parametrize("bad", [
    "-e .", "--index-url=https://evil.example/simple", "-r other.txt", "pkg @ https://evil.example/p.whl",
    "https://evil.example/p.whl", "./local_dir", "/abs/path.whl", "pkg==1; os.system('x')", "pkg\n--pre",
    "", "pkg==1 --hash=sha256:00", "git+https://x/y.git", "pkg[extra]==1 @ file:///etc",
])
def test_hostile_requirements_are_refused(bad):
    with pytest.raises(ValueError, match="requirements"):
        parse_requirements([bad])


def test_requirement_lists_are_checked():
    assert parse_requirements(["sympy>=1.12", "numpy==1.26.4", "attrs[tests]<24; python_version >= '3.8'"]) == (
        'attrs[tests]<24; python_version >= "3.8"', "numpy==1.26.4", "sympy>=1.12")
    for bad in ("numpy", [], [1], ["numpy", "NumPy>=1"]):
        with pytest.raises(ValueError, match="requirements"):
            parse_requirements(bad)


def test_task_files_read_requirements_and_refuse_a_bad_rootfs(tmp_path, monkeypatch):
    monkeypatch.delenv("MC_TASK_ROOTFS_DIR", raising=False)
    base = {"prompt": "p", "tests": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "f"}
    lines = [dict(base, id="a", requirements=["sympy==1.12"]), dict(base, id="b"),
             dict(base, id="c", requirements=["-e ."]), dict(base, id="d", rootfs="/srv/root")]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    tasks, problems = load_code_tasks(path, "jsonl")
    assert [(t.id, t.requirements) for t in tasks] == [("a", ("sympy==1.12",)), ("b", ())]
    assert len(problems) == 2 and "'requirements'" in problems[0] and "rootfs" in problems[1]
    assert "only inside the directory $MC_TASK_ROOTFS_DIR names" in problems[1]  # not set here


def test_hostile_battery_holds_with_a_task_env_mounted(task_site, sandbox_ok, tmp_path):
    """tests/test_sandbox.py again, every Sandbox mounting the task environment instead of the host's."""
    rerun_sandbox_battery(tmp_path, {"site_packages": task_site}, f"self.site_packages == {task_site!r}")


@pytest.fixture
def offline_env_vars(task_site, wheelhouse, env_cache, monkeypatch):
    """The loaders' tasks build through the environment variables; the fixture's environment is the one built."""
    monkeypatch.delenv("MC_TASK_ROOTFS_DIR", raising=False)
    monkeypatch.setenv("MC_TASK_ENV_CACHE", str(env_cache))
    monkeypatch.setenv("MC_TASK_ENV_PIP_ARGS", f"--no-index --find-links {wheelhouse}")


def test_code_task_with_requirements_is_scored_in_its_env(offline_env_vars, sandbox_ok):
    from megatron_composer.rl.tasks.code_tests import run_code_tests
    from megatron_composer.rl.tasks.task_files import CodeTask

    tests = ("import importlib.util\n\ndef check(candidate):\n    assert candidate() == 'from the task env'\n"
             "    assert importlib.util.find_spec('numpy') is None  # a host-only package\n")
    program = "import mc_taskdep\ndef f():\n    return mc_taskdep.VALUE\n"
    with_env = CodeTask(id="t", prompt="p", tests=tests, entry_point="f", requirements=("mc_taskdep==1.2.0",))
    assert run_code_tests(with_env, program, 30.0) == (2, 2)  # two asserts, two units
    assert run_code_tests(CodeTask(id="t", prompt="p", tests=tests, entry_point="f"), program, 30.0) == (0, 2)


def test_swe_instance_with_requirements_verifies_in_its_env(offline_env_vars, sandbox_ok, tmp_path):
    from megatron_composer.rl.tasks.coding import prepare_workspace, run_tests
    from megatron_composer.rl.tasks.coding.swe import load_swe_tasks

    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_dep.py").write_text(
        "import importlib.util\nimport mc_taskdep\n\n"
        "def test_dep():\n    assert mc_taskdep.VALUE == 'from the task env'\n\n"
        "def test_no_host_numpy():\n    assert importlib.util.find_spec('numpy') is None\n")
    record = {"instance_id": "dep-1", "repo_dir": "repo", "problem_statement": "Use the dependency.",
              "FAIL_TO_PASS": ["tests/test_dep.py::test_dep"],
              "PASS_TO_PASS": ["tests/test_dep.py::test_no_host_numpy"]}
    lines = [dict(record, requirements=["mc_taskdep==1.2.0"]), dict(record, instance_id="dep-2"),
             dict(record, instance_id="dep-3", requirements=["--index-url=http://evil.example"]),
             dict(record, instance_id="dep-4", rootfs="/srv/root")]
    (tmp_path / "swe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    tasks, problems = load_swe_tasks(tmp_path / "swe.jsonl")
    assert [(t.key, t.requirements) for t in tasks] == [("swe/dep-1", ("mc_taskdep==1.2.0",)), ("swe/dep-2", ())]
    assert len(problems) == 2 and "'requirements'" in problems[0] and "MC_TASK_ROOTFS_DIR" in problems[1]
    verdicts = []
    for task in tasks:
        workspace = tmp_path / task.key.replace("/", "-")
        prepare_workspace(task, workspace)
        verdict = run_tests(task, workspace)
        verdicts.append((verdict.fail_to_pass_passed, verdict.pass_to_pass_passed))
    assert verdicts == [(1, 1), (0, 0)]  # host mount: no mc_taskdep, so the module fails to import

    from megatron_composer.data.tool_calls import format_tool_call
    from megatron_composer.rl.agent import Agent, AgentConfig
    from megatron_composer.rl.agentic import AgenticCodingEnv
    from tests.agent_fakes import CharTokenizer, ScriptedClient

    tok = CharTokenizer()
    config = AgentConfig(max_context_tokens=16384, max_turn_tokens=4096, max_observation_tokens=4096, max_turns=4)
    env = AgenticCodingEnv(("swe",), split="eval", workdir=str(tmp_path))
    script = [format_tool_call("run", {"command": "python3 -c 'import mc_taskdep; print(mc_taskdep.VALUE)'"}),
              format_tool_call("finish", {"message": "Done."})]
    result = env.episode(Agent(ScriptedClient(tok, script), tok, config), tasks[0])
    assert "from the task env" in result.trajectory.events[0].output  # the agent's own sandbox mounts it too
    assert result.verdict["resolved"] == 1.0


def test_concurrent_builders_build_once(wheelhouse, tmp_path, monkeypatch):
    import threading

    builds = []
    real_build = task_envs._build
    monkeypatch.setattr(task_envs, "_build", lambda *a: (builds.append(a[0]), real_build(*a)))
    args = ["--no-index", "--find-links", str(wheelhouse)]
    results = [None] * 3

    def build(i):
        results[i] = task_env_site_packages(["mc_taskdep==1.2.0"], pip_args=args, base=(), cache=tmp_path)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(builds) == 1 and len(set(results)) == 1 and results[0] is not None
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [Path(builds[0]).name]
