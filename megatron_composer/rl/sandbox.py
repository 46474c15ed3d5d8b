"""A bubblewrap sandbox for commands written by the policy model (hostile input).

    sandbox = Sandbox(workspace, timeout_s=10.0, memory_mb=512)
    result = sandbox.run("python3 -m pytest -q")     # SandboxResult

What the command sees:

- `/workspace` (the host `workspace`, read-write, the cwd) and its own `/tmp`
  and `/dev/shm` (tmpfs, `TMP_SIZE_MB` each) are the only writable paths; the
  root itself is remounted read-only.
- `/usr` and the `/bin`, `/sbin`, `/lib*` links or directories, read-only; a
  synthetic `/etc` (passwd, group, hosts, plus ld.so.cache, alternatives and
  localtime from the host; resolv.conf, nsswitch.conf and the CA certificates
  only with `network=True`); its own `/proc` (only its own processes) and a
  minimal `/dev`.
- The site-packages directory that holds pytest, read-only at
  `SITE_PACKAGES_MOUNT` and on PYTHONPATH, so the system `python3` (not this
  process's interpreter: a virtualenv's lives under /root or /work) can run
  `python3 -m pytest`. Nothing else of the host: no /work, /root, /home or host
  /tmp. `site_packages=` mounts another directory there instead (a task's own
  environment, `rl/task_envs.py`), and the host's is then not mounted at all.
- `rootfs=` (a task's own root filesystem, a directory): its `/usr`, `/bin`,
  `/sbin`, `/lib*` and `/opt`, read-only, in place of the host's, and its
  `/etc/ld.so.cache`, `/etc/alternatives` and `/etc/localtime`; the synthetic
  `/etc` files, `/proc`, `/dev`, `/tmp` and `/workspace` as above; no
  site-packages of the host and no PYTHONPATH (its own `python3` finds its
  own packages). It must hold `/bin/sh` and util-linux's `prlimit` (the
  limits below are set inside), and `python3` with pytest for the verifiers:
  a `python:3.12-slim` image exported with `docker export`, with pytest
  installed, is one. A rootfs whose shell does not run under the limits its
  `prlimit` sets is refused at construction; its `/etc` files are resolved
  here and bound by that resolved path, and one that leads out of it is not
  bound. `rootfs="/"` (the host itself) is refused.
- Environment: PATH, HOME=/tmp, TMPDIR=/tmp, LANG=C.UTF-8,
  PYTHONDONTWRITEBYTECODE=1, PYTHONPATH, and PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  (the bound site-packages is there for pytest alone; scanning its plugins
  costs over a second per run); nothing of the host's. Commands given as a
  str run under `/bin/sh -c` (dash on Debian), lists are an argv.

Isolation: new user, mount, PID, network (unless `network=True`, which
shares the host network, its loopback included), IPC, UTS and cgroup
namespaces; uid/gid `SANDBOX_UID` inside; no capabilities; no nested user
namespaces (`--disable-userns`); `--new-session` (no TIOCSTI into a terminal);
`--die-with-parent`; no new privileges.

Host identity. The kernel exempts processes whose real uid is host root from
RLIMIT_NPROC, and bwrap maps the sandbox uid onto the uid that runs bwrap, so
when this process is root bwrap runs as `HOST_UID` (nobody) instead. An
unprivileged bwrap cannot reach a workspace or site-packages below a root-only
directory (pytest's tmp dirs, a venv under /root), so a root caller first
stages them: `unshare --mount` (as root, a private mount namespace that dies
with the run) bind-mounts both onto a small tmpfs over `/sys` (which the
sandbox never sees), then `setpriv` drops to `HOST_UID` and execs bwrap. The
workspace tree is handed to `HOST_UID` (lchown, never following a symlink)
before each run and back to the workspace's owner after it, setuid/setgid bits
stripped. A non-root caller runs bwrap as itself and nothing is chowned.

Limits, set by `prlimit` inside the sandbox just before the command:
RLIMIT_AS = memory_mb (per process), RLIMIT_CPU = ceil(timeout) soft (SIGXCPU)
and one second more hard (SIGKILL) as a backstop to the wall clock,
RLIMIT_NPROC = max_processes, RLIMIT_FSIZE = `FILE_SIZE_MB`, RLIMIT_NOFILE =
`MAX_OPEN_FILES`, no core files. RLIMIT_NPROC is set after bwrap created the
user namespace, so since Linux 5.14 (per-user-namespace counts) it bounds the
processes of this sandbox alone, not of all sandboxes together.

The wall clock: on timeout the PID namespace's init (its pid from bwrap's
`--info-fd`, held by a pidfd) and bwrap are SIGKILLed, and the kernel kills
every process of that namespace (no process can leave it; `--die-with-parent`
is the fallback). The same happens when the command exits and leaves background
processes behind. A run returns only once that init has exited, so no process
of it is alive afterwards; the init's zombie is the host init's to reap.

Output: stdout and stderr are read concurrently (one selector loop, also
feeding stdin) up to `max_output_bytes` each; past the cap the reader keeps
reading and discarding so the command never blocks on a full pipe, and
`truncated` is set. A flood such as `yes` therefore runs until the wall clock.

Exit codes follow the shell: the command's exit status, or 128+N when signal N
killed it (bwrap reports it so); a timeout reports 137 (128+SIGKILL) with
`timed_out=True`.

Known limits: memory is bounded per process (RLIMIT_AS), not for the sandbox
as a whole (up to max_processes * memory_mb); disk use in the workspace is
bounded per file (RLIMIT_FSIZE), not in total; CPU time is per process; one
run at a time per Sandbox (runs of one instance are serialized; two instances
must not share a workspace); the host side must treat the workspace as hostile
afterwards (symlinks, hard links inside it, huge trees); /proc/self/mountinfo
shows the host path names (not contents) of the workspace, site-packages and rootfs;
the sandbox's init shows PWD=/ in its environment; RLIMIT_NPROC is per sandbox
only on Linux >= 5.14 (before, per host uid across concurrent sandboxes);
`network=True` shares the host network, loopback and abstract sockets included.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import select
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time

BWRAP_PATH = shutil.which("bwrap") or "/usr/bin/bwrap"  # tests point it elsewhere
SANDBOX_UID = 1000
HOST_UID = 65534
TMP_SIZE_MB = 64
FILE_SIZE_MB = 256
MAX_OPEN_FILES = 256
SITE_PACKAGES_MOUNT = "/opt/sandbox/site-packages"
SHELL = "/bin/sh"

_INSTALL_HINT = "bubblewrap (bwrap) is not installed; install it with `apt-get install -y bubblewrap`"
_DRAIN_S = 5.0  # after a kill, how long to wait for the pipes to close and the namespace to empty


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` becomes readable within `timeout_s` (poll, not select: select fails on a descriptor
    numbered 1024 or above, which a long-running process with many open files reaches)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(timeout_s * 1000)))
_INFO_FD = "INFO_FD"  # placeholder in the argv for the pipe that receives bwrap's JSON (its child's pid)
_READ_CHUNK = 1 << 16

# The root caller's staging step; $1 workspace, $2 site-packages, $3 rootfs (or ""), then setpriv's argv.
_STAGE_SCRIPT = r"""set -e
mount -t tmpfs -o mode=0755,size=64k megatron-sandbox /sys
mkdir /sys/workspace /sys/site-packages /sys/rootfs
mount --bind "$1" /sys/workspace
if [ -n "$2" ]; then mount --bind "$2" /sys/site-packages; fi
if [ -n "$3" ]; then mount --rbind "$3" /sys/rootfs; fi
shift 3
exec "$@"
"""
_STAGED_WORKSPACE = "/sys/workspace"
_STAGED_SITE_PACKAGES = "/sys/site-packages"
_STAGED_ROOTFS = "/sys/rootfs"
# the top-level entries of the system that are bound read-only (from the host's root or a task's rootfs)
_SYSTEM_TOPS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
_SYSTEM_ETC = ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create its namespaces on this machine."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    seconds: float


_probe_lock = threading.Lock()
_probe_cache: dict[tuple[str, int], str | None] = {}  # (bwrap, euid) -> None if usable else the error
_rootfs_ok: set[tuple[str, int]] = set()  # (rootfs, euid) whose probe passed (a failed probe is not kept)
_rootfs_locks: dict[tuple[str, int], threading.Lock] = {}


class Sandbox:
    def __init__(self, workspace, *, timeout_s: float = 10.0, memory_mb: int = 512, max_processes: int = 64,
                 max_output_bytes: int = 65536, network: bool = False, site_packages: str | None = None,
                 rootfs: str | None = None):
        path = os.path.realpath(os.fspath(workspace))
        if not os.path.isdir(path):
            raise ValueError(f"workspace {os.fspath(workspace)!r} is not an existing directory; create it first "
                             "(os.makedirs) and pass its path")
        _check_timeout(timeout_s, "timeout_s")
        _check_positive_int(memory_mb, "memory_mb", "e.g. 512")
        _check_positive_int(max_processes, "max_processes", "e.g. 64")
        _check_positive_int(max_output_bytes, "max_output_bytes", "e.g. 65536", allow_zero=True)
        if not isinstance(network, bool):
            raise ValueError(f"network={network!r} must be True or False")
        if site_packages is not None:
            site_packages = os.path.realpath(os.fspath(site_packages))
            if not os.path.isdir(site_packages):
                raise ValueError(f"site_packages={site_packages!r} is not an existing directory; pass a "
                                 "site-packages from rl/task_envs.task_env_site_packages or None for the host's")
        if rootfs is not None:
            if site_packages is not None:
                raise ValueError("site_packages= and rootfs= exclude each other: a rootfs brings its own python3 "
                                 "and packages; install the task's requirements into the rootfs")
            rootfs = os.path.realpath(os.fspath(rootfs))
            if rootfs == "/":
                raise ValueError("rootfs='/' is the host's own root; pass None for the host's system, or the "
                                 "directory of a separate root filesystem")
            if not os.path.isdir(os.path.join(rootfs, "usr")):
                raise ValueError(f"rootfs={rootfs!r} is not a root filesystem (no usr/ directory in it); pass the "
                                 "directory an image was extracted to, e.g. by `docker export ... | tar -x -C DIR`")
        self.site_packages = site_packages
        self.rootfs = rootfs
        self.workspace = path
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.max_output_bytes = max_output_bytes
        self.network = network
        st = os.stat(path)
        self._owner = (st.st_uid, st.st_gid)
        self._as_root = os.geteuid() == 0
        self._lock = threading.Lock()
        ensure_available()
        if rootfs is not None:
            _check_rootfs(rootfs)

    def run(self, cmd: str | list[str], *, timeout_s: float | None = None,
            stdin: str | bytes | None = None) -> SandboxResult:
        argv = _command_argv(cmd)
        timeout = self.timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        if isinstance(stdin, str):
            stdin = stdin.encode()
        elif stdin is not None and not isinstance(stdin, bytes):
            raise ValueError(f"stdin must be str, bytes or None, not {type(stdin).__name__}")
        with self._lock:
            if self._as_root:
                _chown_tree(self.workspace, HOST_UID, HOST_UID)
            try:
                return _execute(_sandbox_argv(self.workspace, self.network, self.memory_mb, self.max_processes,
                                              timeout, argv, self.site_packages, self.rootfs), stdin, timeout,
                                self.max_output_bytes)
            finally:
                if self._as_root:
                    _chown_tree(self.workspace, *self._owner, strip_setid=True)


def _sandbox_argv(workspace: str, network: bool, memory_mb: int, max_processes: int, timeout: float,
                  command: list[str], site_packages: str | None = None, rootfs: str | None = None) -> list[str]:
    """The whole argv: bwrap, or for a root caller the staging, setpriv and then bwrap; then prlimit."""
    site = None if rootfs else site_packages or _site_packages()
    limits = _limits_argv(memory_mb, max_processes, timeout)
    if os.geteuid() != 0:
        return _bwrap_argv(workspace, site, network, rootfs) + limits + command
    # --pdeathsig: bwrap (which setpriv becomes) is killed with the process that started it, so a worker
    # killed mid-command leaves no sandbox behind (bwrap's --die-with-parent guards only its own child)
    setpriv = ["setpriv", f"--reuid={HOST_UID}", f"--regid={HOST_UID}", "--clear-groups", "--inh-caps=-all",
               "--no-new-privs", "--pdeathsig", "KILL", "--"]
    staged_site = _STAGED_SITE_PACKAGES if site else None
    return (["unshare", "--mount", "--propagation", "private", "--", SHELL, "-c", _STAGE_SCRIPT, "stage",
             workspace, site or "", rootfs or ""] + setpriv
            + _bwrap_argv(_STAGED_WORKSPACE, staged_site, network, rootfs,
                          staged_rootfs=_STAGED_ROOTFS if rootfs else None)
            + limits + command)


def ensure_available() -> None:
    """Raise SandboxUnavailable unless a trivial sandbox runs here (probed once per bwrap path and euid)."""
    key = (BWRAP_PATH, os.geteuid())
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe()
        error = _probe_cache[key]
    if error is not None:
        raise SandboxUnavailable(error)


def _probe() -> str | None:
    if not (os.path.isfile(BWRAP_PATH) and os.access(BWRAP_PATH, os.X_OK)):
        return f"{_INSTALL_HINT} (looked for {BWRAP_PATH})"
    tools = ["prlimit"] + (["unshare", "setpriv", "mount"] if os.geteuid() == 0 else [])
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"the sandbox needs util-linux's {', '.join(missing)}; install it with `apt-get install -y util-linux`"
    with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as workspace:
        if os.geteuid() == 0:
            os.chown(workspace, HOST_UID, HOST_UID)
        result = _execute(_sandbox_argv(workspace, False, 256, 16, 10.0, ["true"]), None, 10.0, 4096)
    if result.exit_code == 0:
        return None
    said = result.stderr.strip() or f"exit code {result.exit_code}"
    if "namespace" in said or "uid map" in said or "Operation not permitted" in said:
        return (f"bubblewrap cannot create user namespaces here ({said}); allow them with "
                "`sysctl -w kernel.unprivileged_userns_clone=1` (Debian), `sysctl -w user.max_user_namespaces=15000`, "
                "or on Ubuntu 24.04+ `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`")
    return f"bubblewrap failed to start a trivial sandbox: {said}"


def _check_rootfs(rootfs: str) -> None:
    """ValueError unless a sandbox on `rootfs` runs its shell under the limits its `prlimit` set (probed once
    per path and euid; a failure is probed again next time)."""
    key = (rootfs, os.geteuid())
    with _probe_lock:
        lock = _rootfs_locks.setdefault(key, threading.Lock())
    with lock:
        if key in _rootfs_ok:
            return
        memory_mb, processes = 256, 16
        read_limits = ["/bin/sh", "-c", 'while read -r line; do echo "$line"; done < /proc/self/limits']
        with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as workspace:
            if os.geteuid() == 0:
                os.chown(workspace, HOST_UID, HOST_UID)
            result = _execute(_sandbox_argv(workspace, False, memory_mb, processes, 10.0, read_limits, rootfs=rootfs),
                              None, 10.0, 65536)
        limits = {" ".join(line.split()[:-3]): line.split()[-3:-1] for line in result.stdout.splitlines()[1:]
                  if len(line.split()) >= 4}
        if result.exit_code != 0:
            problem = result.stderr.strip()[-300:] or f"exit code {result.exit_code}"
        elif (limits.get("Max address space") != [str(memory_mb << 20)] * 2
              or limits.get("Max processes") != [str(processes)] * 2):
            problem = (f"its prlimit did not set the limits: address space {limits.get('Max address space')}, "
                       f"processes {limits.get('Max processes')}")
        else:
            _rootfs_ok.add(key)
            return
    raise ValueError(f"rootfs={rootfs!r} cannot run a command in the sandbox ({problem}); it needs /bin/sh and "
                     "util-linux's prlimit (and python3 with pytest for the verifiers), readable by all users")


def _site_packages() -> str | None:
    spec = importlib.util.find_spec("pytest")
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))


def _bwrap_argv(workspace: str, site_packages: str | None, network: bool, rootfs: str | None = None, *,
                staged_rootfs: str | None = None) -> list[str]:
    """bwrap's argv up to `--`. `rootfs`: the task's root filesystem on the host (its layout is read
    there), bound from `staged_rootfs` when a root caller staged it."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if site_packages:
        env["PYTHONPATH"] = SITE_PACKAGES_MOUNT
    argv = [BWRAP_PATH, "--unshare-all", "--unshare-user", "--disable-userns", "--info-fd", _INFO_FD]
    if network:
        argv.append("--share-net")
    argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
             "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    root, source = rootfs or "/", staged_rootfs or rootfs or "/"
    for top in _SYSTEM_TOPS + (("opt",) if rootfs else ()):
        here = os.path.join(root, top)
        if os.path.islink(here):
            argv += ["--symlink", os.readlink(here), "/" + top]
        elif os.path.isdir(here):
            argv += ["--ro-bind", os.path.join(source, top), "/" + top]
    tmp_bytes = str(TMP_SIZE_MB << 20)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", tmp_bytes, "--tmpfs", "/dev/shm",
             "--size", tmp_bytes, "--tmpfs", "/tmp"]
    etc = list(_SYSTEM_ETC)
    if network:
        etc += ["/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/gai.conf", "/etc/ssl", "/etc/ca-certificates"]
    for path in etc:
        if rootfs:  # a rootfs's own, resolved here and bound by that resolved path, which has no link left to follow
            found = _inside(root, path)
            if found is not None:
                argv += ["--ro-bind", os.path.join(source, found), path]
        else:
            argv += ["--ro-bind-try", path, path]
    for path, text in _synthetic_etc().items():
        argv += ["--perms", "0644", "--ro-bind-data", text, path]  # the text is swapped for a pipe fd in _execute
    argv += ["--bind", workspace, "/workspace"]
    if site_packages:
        argv += ["--ro-bind", site_packages, SITE_PACKAGES_MOUNT]
    argv += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/workspace", "--"]
    return argv


def _inside(root: str, path: str) -> str | None:
    """`path` of the root filesystem `root`, resolved on the host, as a path relative to `root` without links;
    None when it does not exist or leads out of `root` (a link to the host's files)."""
    try:
        real = os.path.realpath(os.path.join(root, path.lstrip("/")), strict=True)
    except (OSError, RuntimeError):
        return None
    return os.path.relpath(real, root) if real.startswith(root.rstrip("/") + "/") else None


def _synthetic_etc() -> dict[str, str]:
    uid = SANDBOX_UID
    return {
        "/etc/passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n"
                       "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "/etc/group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n",
        "/etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    }


def _limits_argv(memory_mb: int, max_processes: int, timeout: float) -> list[str]:
    cpu = max(1, math.ceil(timeout))
    return ["prlimit", f"--as={memory_mb << 20}", f"--cpu={cpu}:{cpu + 1}", f"--nproc={max_processes}",
            f"--fsize={FILE_SIZE_MB << 20}", f"--nofile={MAX_OPEN_FILES}", "--core=0", "--"]


def _command_argv(cmd) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError(f"cmd {cmd!r} is empty; pass a shell command such as 'echo hi' or an argv list")
        argv = [SHELL, "-c", cmd]
    elif isinstance(cmd, (list, tuple)):
        if not cmd or not all(isinstance(a, str) for a in cmd) or not cmd[0]:
            raise ValueError(f"cmd {cmd!r} must be a non-empty list of str with a non-empty program, "
                             "e.g. ['python3', '-c', 'pass']")
        argv = list(cmd)
    else:
        raise ValueError(f"cmd must be a str (run by {SHELL} -c) or a list of str, not {type(cmd).__name__}")
    for arg in argv:
        if "\0" in arg:
            raise ValueError(f"cmd argument {arg!r} contains a NUL byte, which no argv can carry; remove it")
    return argv


def _check_timeout(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds, e.g. 10.0")
    return float(value)


def _check_positive_int(value, name: str, example: str, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}, {example}")


def _execute(argv: list[str], stdin: bytes | None, timeout: float, cap: int) -> SandboxResult:
    """Run argv (bwrap or its staging) to completion or the wall clock; see the module docstring."""
    argv, pass_fds, info = _pipes(argv)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds, env={},
                                cwd="/", process_group=0)
    except BaseException:
        os.close(info)
        raise
    finally:
        for fd in pass_fds:
            os.close(fd)
    init = _Init()
    try:
        out, err, truncated, timed_out = _communicate(proc, stdin, start + timeout, cap, info, init)
    finally:
        if proc.poll() is None:
            _kill(proc, init)
        proc.wait()
        init.wait_gone()
    seconds = time.monotonic() - start
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    if timed_out:
        code = 128 + signal.SIGKILL
    return SandboxResult(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out, truncated,
                         seconds)


class _Init:
    """The sandbox's PID-namespace init, held by a pidfd: killing it kills the whole namespace.

    bwrap exits as soon as the command does, while its init may still be killing what the command left
    behind (a fork bomb), so a run waits for the init too: once it has exited the namespace is empty.
    """

    def __init__(self):
        self.pidfd: int | None = None

    def attach(self, info_json: bytes) -> None:
        try:
            pid = json.loads(info_json)["child-pid"]
            self.pidfd = os.pidfd_open(pid)
        except (ValueError, KeyError, TypeError, OSError):
            self.pidfd = None  # bwrap failed before starting its child, or the child is already gone

    def kill(self) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_gone(self) -> None:
        if self.pidfd is None:
            return
        if not _readable(self.pidfd, _DRAIN_S):
            self.kill()
            _readable(self.pidfd, _DRAIN_S)
        os.close(self.pidfd)
        self.pidfd = None


def _pipes(argv: list[str]) -> tuple[list[str], list[int], int]:
    """Fill the argv's placeholders with pipe fds: each `--ro-bind-data TEXT` gets a pipe holding TEXT (well
    under a pipe's buffer), `--info-fd` the write end of a pipe whose read end is returned."""
    argv, pass_fds = list(argv), []
    info_read = info_write = -1
    for i, arg in enumerate(argv[:-1]):
        if arg == "--ro-bind-data" and not argv[i + 1].isdigit():
            read_fd, write_fd = os.pipe()
            os.write(write_fd, argv[i + 1].encode())
            os.close(write_fd)
            pass_fds.append(read_fd)
            argv[i + 1] = str(read_fd)
        elif arg == "--info-fd" and argv[i + 1] == _INFO_FD:
            info_read, info_write = os.pipe()
            pass_fds.append(info_write)
            argv[i + 1] = str(info_write)
    return argv, pass_fds, info_read


def _communicate(proc: subprocess.Popen, stdin: bytes | None, deadline: float, cap: int, info: int, init: _Init):
    """Feed stdin, read both pipes and bwrap's info until EOF, killing the sandbox at the deadline."""
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    info_json = bytearray()
    truncated = timed_out = False
    with selectors.DefaultSelector() as selector:
        for pipe in buffers:
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ)
        selector.register(info, selectors.EVENT_READ)
        pending = memoryview(stdin or b"")
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out:
                    break  # still open after the kill and the drain: give up on the pipes
                timed_out = True
                _kill(proc, init)
                deadline = time.monotonic() + _DRAIN_S
                continue
            for key, _ in selector.select(remaining):
                pipe = key.fileobj
                if pipe is proc.stdin:
                    try:
                        pending = pending[os.write(pipe.fileno(), pending[:_READ_CHUNK]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]  # the command closed its stdin; the rest is dropped
                    if not pending:
                        selector.unregister(pipe)
                        pipe.close()
                    continue
                chunk = os.read(key.fd, _READ_CHUNK)
                if pipe is info:
                    info_json += chunk
                    if not chunk:
                        selector.unregister(info)
                        init.attach(bytes(info_json))
                    continue
                if not chunk:
                    selector.unregister(pipe)
                    continue
                buffer = buffers[pipe]
                room = cap - len(buffer)
                if len(chunk) > room:
                    truncated = True
                if room > 0:
                    buffer += chunk[:room]
    os.close(info)
    for pipe in buffers:
        pipe.close()
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), truncated, timed_out


def _kill(proc: subprocess.Popen, init: _Init) -> None:
    """SIGKILL the namespace's init (the kernel then kills every process in it) and bwrap's process group."""
    init.kill()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our child, not yet waited for: its pid cannot be reused
    except ProcessLookupError:
        pass


def _chown_tree(root: str, uid: int, gid: int, strip_setid: bool = False) -> None:
    """lchown every entry under root (iteratively: a hostile tree may be deeper than Python's recursion limit).

    Handing over (strip_setid False) skips files with several links: a hard link placed in the workspace by
    someone on the host could name a host file. Handing back strips setuid/setgid bits from regular files.
    """
    stack = [root]
    while stack:
        path = stack.pop()
        try:
            st = os.lstat(path)
            if not strip_setid and not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
                continue
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.chown(path, uid, gid, follow_symlinks=False)
            if strip_setid and stat.S_ISREG(st.st_mode) and st.st_mode & 0o6000:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    os.fchmod(fd, st.st_mode & 0o1777)
                finally:
                    os.close(fd)
            if stat.S_ISDIR(st.st_mode):
                with os.scandir(path) as entries:
                    stack.extend(entry.path for entry in entries)
        except OSError:
            continue  # an entry the host cannot handle (name too long, vanished) stays as the sandbox left it

