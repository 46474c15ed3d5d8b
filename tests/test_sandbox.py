"""The RL sandbox against hostile commands (`megatron_composer/rl/sandbox.py`).

These tests need bubblewrap and fail (never skip) without it, naming the
install command: CI installs it. Every test is followed by the `host_intact`
check: no process of any sandbox is left, the host canary directory (outside
the workspace) is unchanged, and a fresh sandbox still runs a command.
"""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from megatron_composer.rl import sandbox as sandbox_module
from megatron_composer.rl.sandbox import Sandbox, SandboxResult, SandboxUnavailable

BOMB_TIMEOUT_S = 3.0


def _live_processes():
    """(pid, ppid, cwd (dev, inode) or None) of every live host process; zombies are left out (a sandbox's
    exited init waits there for the host's init to reap it)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z":
            continue
        try:
            st = os.stat(f"/proc/{name}/cwd")
            cwd = (st.st_dev, st.st_ino)
        except OSError:
            cwd = None
        yield int(name), int(fields[1]), cwd


def _sandbox_processes(root) -> list[int]:
    """Live processes of this test's sandboxes: descendants of this process (bar the test's own host
    helpers, which are not in another PID namespace), or orphans whose cwd is a directory under root (a
    sandbox's /workspace is the host directory itself)."""
    own_ns = os.readlink("/proc/self/ns/pid")
    dirs = set()
    for base, names, _ in os.walk(root):
        for name in names + ["."]:
            st = os.stat(os.path.join(base, name))
            dirs.add((st.st_dev, st.st_ino))
    processes = list(_live_processes())
    parent = {pid: ppid for pid, ppid, _ in processes}
    found = []
    for pid, _, cwd in processes:
        ancestor, seen = pid, 0
        while ancestor in parent and ancestor != os.getpid() and seen < 64:
            ancestor, seen = parent[ancestor], seen + 1
        try:
            foreign = os.readlink(f"/proc/{pid}/ns/pid") != own_ns
        except OSError:
            continue
        if foreign and (ancestor == os.getpid() or cwd in dirs):
            found.append(pid)
    return found


def _describe(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read()[:60]
    except OSError:
        return f"{pid} (gone)"


def _snapshot(root) -> dict[str, bytes]:
    found = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            found[os.path.relpath(path, root)] = b"" if os.path.isdir(path) else open(path, "rb").read()
    return found


@pytest.fixture
def workspace(tmp_path):
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
def canary(tmp_path):
    """A host directory next to the workspace, with a file the sandbox must never see or change."""
    path = tmp_path / "canary"
    path.mkdir()
    (path / "secret.txt").write_text("canary-secret-1234\n")
    return path


@pytest.fixture(autouse=True)
def host_intact(tmp_path, canary):
    before_canary = _snapshot(canary)
    yield
    leftover = _sandbox_processes(tmp_path)
    assert not leftover, f"sandbox processes survived: {[_describe(pid) for pid in leftover]}"
    assert _snapshot(canary) == before_canary
    fresh = tmp_path / "fresh"
    fresh.mkdir(exist_ok=True)
    result = Sandbox(fresh, timeout_s=10).run("echo ok")
    assert (result.exit_code, result.stdout) == (0, "ok\n"), result


def test_fork_bomb_is_bounded_and_returns(workspace):
    start = time.monotonic()
    before = sum(1 for _ in _live_processes())
    # the top-level shell stays a second, so the bomb always meets the limit before the run ends
    # (alone, `:` returns at once and the run can end, killing the bomb, before it forks 32 times)
    bomb = ":(){ :|:& };:; sleep 1"
    result = Sandbox(workspace, max_processes=32, timeout_s=BOMB_TIMEOUT_S).run(["bash", "-c", bomb])
    assert time.monotonic() - start < BOMB_TIMEOUT_S + 3
    assert "fork: retry: Resource temporarily unavailable" in result.stderr, result
    assert sum(1 for _ in _live_processes()) < before + 20  # the bomb's 32 are gone (others may run sandboxes)


def test_process_limit_applies_inside(workspace):
    # The kernel exempts host root from RLIMIT_NPROC; the sandbox must not run as host root.
    code = ("import os, time\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print(n, e.errno)")
    result = Sandbox(workspace, max_processes=16, timeout_s=BOMB_TIMEOUT_S).run(["python3", "-c", code])
    forked, errno = result.stdout.split()
    assert 1 < int(forked) < 16 and errno == "11", result  # EAGAIN


def test_memory_bomb_fails(workspace):
    sandbox = Sandbox(workspace, memory_mb=256, timeout_s=BOMB_TIMEOUT_S)
    result = sandbox.run(["python3", "-c", "x = bytearray(4 << 30)"])
    assert result.exit_code != 0 and "MemoryError" in result.stderr, result
    result = sandbox.run(["python3", "-c", "a = []\nwhile True: a.append(bytearray(32 << 20))"])
    assert result.exit_code != 0 and not result.timed_out and "MemoryError" in result.stderr, result


def test_infinite_loop_times_out_and_nothing_survives(workspace):
    marker = "31415.9265"  # a sleep argument no other process uses
    script = f"sleep {marker} & (sleep {marker} &) ; while :; do :; done"
    result = Sandbox(workspace, timeout_s=2).run(script)
    assert result.timed_out and result.exit_code == 137 and result.seconds < 4, result
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = open(f"/proc/{name}/cmdline", "rb").read()
            except OSError:
                continue
            assert marker.encode() not in cmdline, f"pid {name} survived: {cmdline!r}"


def test_stdout_flood_is_truncated_and_fast(workspace):
    result = Sandbox(workspace, timeout_s=2, max_output_bytes=10_000).run("yes")
    assert result.truncated and len(result.stdout) == 10_000 and result.stdout.startswith("y\ny\n")
    assert result.seconds < 4
    result = Sandbox(workspace, max_output_bytes=100).run("head -c 5000 /dev/zero | tr '\\0' e >&2; echo done")
    assert result.truncated and result.stderr == "e" * 100 and result.stdout == "done\n" and result.exit_code == 0


def test_writes_outside_the_workspace_do_not_reach_the_host(workspace, canary):
    (workspace / "link").symlink_to(canary)  # planted on the host side
    (workspace / "rel").symlink_to(os.path.join("..", canary.name))
    tag = f"sandbox-escape-{os.getpid()}"
    targets = [f"/tmp/{tag}", f"/etc/{tag}", f"/usr/{tag}", f"/root/{tag}", f"{canary}/{tag}",
               f"../{canary.name}/{tag}", f"/workspace/../{tag}", f"link/{tag}", f"rel/{tag}", f"made/{tag}"]
    script = f"ln -s {canary} made; " + "; ".join(f"echo pwn > {t}" for t in targets) + "; true"
    result = Sandbox(workspace).run(script)
    assert result.exit_code == 0
    assert not os.path.exists(f"/tmp/{tag}") and not os.path.exists(f"/etc/{tag}")
    assert not os.path.exists(f"/usr/{tag}") and not os.path.exists(f"/root/{tag}")
    assert not os.path.exists(workspace.parent / tag)
    assert os.listdir(canary) == ["secret.txt"]


def test_host_files_are_not_readable(workspace, canary):
    secret = canary / "secret.txt"
    script = f"cat {secret}; cat ../canary/secret.txt; ls /root /work /home; ls /tmp; cat /proc/1/environ"
    result = Sandbox(workspace).run(script)
    assert "canary-secret" not in result.stdout + result.stderr
    assert result.stdout.strip("\0").strip() in ("", "PWD=/"), result  # PWD=/ is bwrap's own environment
    assert Sandbox(workspace).run("ls /work/main /root/.bashrc").exit_code != 0


def test_host_loopback_is_unreachable(workspace):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    connect = ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('in')"]
    try:
        result = Sandbox(workspace, timeout_s=5).run(connect)
        assert result.exit_code != 0 and "in" not in result.stdout, result
        with pytest.raises(socket.timeout):
            server.accept()
        # The same probe gets through when the network is shared: the check above can fail.
        assert Sandbox(workspace, timeout_s=5, network=True).run(connect).stdout == "in\n"
    finally:
        server.close()


def test_host_processes_cannot_be_signalled(workspace):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result = Sandbox(workspace).run(f"kill -9 {victim.pid}; kill -9 -1; kill -KILL 1; echo alive")
        time.sleep(0.2)
        assert victim.poll() is None
        assert result.stdout == "alive\n" or result.exit_code == 137, result
    finally:
        victim.kill()
        victim.wait()


def test_rm_rf_root_spares_the_host(workspace, canary):
    (workspace / "task.py").write_text("x = 1\n")
    Sandbox(workspace, timeout_s=3).run("rm -rf --no-preserve-root / ; rm -rf /workspace/.. ; true")
    assert (canary / "secret.txt").read_text() == "canary-secret-1234\n"
    assert os.path.isdir(workspace) and os.path.exists("/usr/bin/python3")


def test_identity_and_process_view(workspace):
    sandbox = Sandbox(workspace)
    assert sandbox.run("id -u; id -g").stdout == f"{sandbox_module.SANDBOX_UID}\n{sandbox_module.SANDBOX_UID}\n"
    pids = [int(p) for p in sandbox.run("ls /proc").stdout.split() if p.isdigit()]
    assert os.getpid() not in pids and 1 <= len(pids) <= 4 and max(pids) < 20, pids
    assert sandbox.run("grep Cap /proc/self/status").stdout.count("0000000000000000") >= 3


def test_files_come_back_to_the_caller(workspace):
    (workspace / "given.txt").write_text("from the host\n")
    result = Sandbox(workspace).run(
        "cat given.txt; echo more >> given.txt; umask 077; mkdir -p d; echo x > d/made; cp /bin/sh s; chmod 6755 s")
    assert result.stdout == "from the host\n", result
    owner = (os.stat(workspace).st_uid, os.stat(workspace).st_gid)
    for path in (workspace / "given.txt", workspace / "d", workspace / "d" / "made", workspace / "s"):
        assert (os.stat(path).st_uid, os.stat(path).st_gid) == owner, path
    assert (workspace / "d" / "made").read_text() == "x\n"
    assert os.stat(workspace / "s").st_mode & 0o6000 == 0  # no setuid binary is handed back


def test_cpu_time_limit(workspace):
    limits = Sandbox(workspace, timeout_s=2.5).run("cat /proc/self/limits").stdout
    assert [line.split()[3:5] for line in limits.splitlines() if line.startswith("Max cpu time")] == [["3", "4"]]
    raise_hard = Sandbox(workspace).run("prlimit --pid $$ --cpu=unlimited:unlimited")
    assert raise_hard.exit_code != 0
    burn = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 3))\nwhile True: pass"
    # 15 s of wall clock for 1 s of CPU: the CPU limit still acts first on a machine busy with other tests
    result = Sandbox(workspace, timeout_s=15).run(["python3", "-c", burn])
    assert result.exit_code == 128 + 24 and not result.timed_out, result  # SIGXCPU


def test_file_size_limit(workspace, monkeypatch):
    monkeypatch.setattr(sandbox_module, "FILE_SIZE_MB", 1)
    result = Sandbox(workspace).run("head -c 3000000 /dev/zero > big")
    assert result.exit_code == 128 + 25, result  # SIGXFSZ
    assert os.path.getsize(workspace / "big") == 1 << 20


def test_open_files_limit(workspace):
    code = "fs = []\ntry:\n    while True: fs.append(open('/dev/null'))\nexcept OSError as e: print(len(fs), e.errno)"
    count, errno = Sandbox(workspace).run(["python3", "-c", code]).stdout.split()
    assert int(count) < sandbox_module.MAX_OPEN_FILES and errno == "24"


def test_stdin(workspace):
    sandbox = Sandbox(workspace)
    assert sandbox.run("cat", stdin="héllo").stdout == "héllo"
    assert sandbox.run(["wc", "-c"], stdin=b"\x00\xff" * 500_000).stdout.strip() == "1000000"
    assert sandbox.run("cat").stdout == ""
    assert sandbox.run("true", stdin=b"x" * 1_000_000).exit_code == 0  # a command that never reads


def test_exit_codes_and_command_forms(workspace):
    sandbox = Sandbox(workspace)
    assert sandbox.run("exit 7").exit_code == 7
    assert sandbox.run("kill -TERM $$").exit_code == 128 + 15
    assert sandbox.run(["false"]).exit_code == 1
    assert sandbox.run(["no-such-program"]).exit_code != 0
    assert sandbox.run("echo $HOME").stdout == "/tmp\n"
    assert sandbox.run(["echo", "$HOME", "a b"]).stdout == "$HOME a b\n"
    result = sandbox.run("echo out; echo err >&2")
    assert isinstance(result, SandboxResult) and (result.stdout, result.stderr) == ("out\n", "err\n")
    assert not result.timed_out and not result.truncated and 0 < result.seconds < 5


def test_pytest_runs_inside(workspace):
    (workspace / "test_tiny.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    (workspace / "test_bad.py").write_text("def test_bad():\n    assert 1 + 1 == 3\n")
    sandbox = Sandbox(workspace, timeout_s=30)
    result = sandbox.run("python3 -m pytest -q -p no:cacheprovider test_tiny.py")
    assert result.exit_code == 0 and "1 passed" in result.stdout, result
    assert sandbox.run("python3 -m pytest -q -p no:cacheprovider test_bad.py").exit_code == 1


def test_host_environment_does_not_leak(workspace, monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "s3cr3t-env")
    env = Sandbox(workspace).run("env; cat /proc/self/environ").stdout
    assert "s3cr3t-env" not in env and "SANDBOX_TEST_SECRET" not in env
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "LANG=C.UTF-8" in env


def test_concurrent_sandboxes(tmp_path):
    results = {}

    def one(i):
        path = tmp_path / f"ws{i}"
        path.mkdir()
        results[i] = Sandbox(path).run(f"sleep 0.5; echo {i} > out; cat out")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i}\n" for i in range(4)}
    assert time.monotonic() - start < 1.5


def test_bad_arguments(tmp_path, workspace):
    with pytest.raises(ValueError, match="does not exist|not an existing directory"):
        Sandbox(tmp_path / "missing")
    for kwargs, name in [({"timeout_s": -1}, "timeout_s"), ({"memory_mb": 0}, "memory_mb"),
                         ({"max_processes": -3}, "max_processes"), ({"max_output_bytes": -1}, "max_output_bytes")]:
        with pytest.raises(ValueError, match=name):
            Sandbox(workspace, **kwargs)
    sandbox = Sandbox(workspace)
    for cmd in ["", "   ", [], [""]]:
        with pytest.raises(ValueError, match="cmd"):
            sandbox.run(cmd)
    with pytest.raises(ValueError, match="NUL"):
        sandbox.run(["echo", "a\0b"])
    with pytest.raises(ValueError, match="timeout_s"):
        sandbox.run("true", timeout_s=0)


def test_missing_bwrap_is_a_clear_error(workspace, monkeypatch):
    monkeypatch.setattr(sandbox_module, "BWRAP_PATH", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match=r"apt-get install -y bubblewrap"):
        Sandbox(workspace)
