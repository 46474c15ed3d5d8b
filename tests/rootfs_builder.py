"""A small root filesystem for the sandbox's `rootfs=` tests, copied from this machine's own system.

    build_rootfs(dest)   # dest/usr/... with sh, bash, prlimit, coreutils, python3 + pytest; bin -> usr/bin ...

It holds only what it is given: the programs in `PROGRAMS` (as they are here,
links kept), the shared libraries they and Python's extension modules load
(found by `ldd`), the dynamic loader, Python's standard library and pytest
with its dependencies under `/usr/lib/python3/dist-packages`, `ld.so.cache`,
and a marker file `usr/share/rootfs-marker` the host does not have. The
host's other programs (bwrap, git, apt ...) and site-packages are absent, so
a test can tell which system a sandbox runs on. About 60 MB, a few seconds.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

MARKER = "usr/share/rootfs-marker"
MARKER_TEXT = "a task's own root filesystem\n"
# what the sandbox itself needs (sh, prlimit) and what tests/test_sandbox.py's commands run
PROGRAMS = ("sh", "dash", "bash", "prlimit", "python3", "echo", "yes", "head", "tr", "cat", "ls", "kill", "rm", "id",
            "grep", "wc", "false", "true", "sleep", "env", "test", "mkdir", "touch", "chmod", "stat", "ps", "cp")
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")


def _copy(src: str, root: Path) -> None:
    """`src` at the same path under `root`, a link as a link (its target copied too)."""
    dest = root / src.lstrip("/")
    if dest.exists() or dest.is_symlink():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.islink(src):
        target = os.readlink(src)
        os.symlink(target, dest)
        _copy(os.path.normpath(os.path.join(os.path.dirname(src), target)), root)
    elif os.path.isdir(src):
        shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "test", "tests",
                                                                               "idlelib", "tkinter", "ensurepip"))
    else:
        shutil.copy2(src, dest)


def _libraries(paths: list[str]) -> set[str]:
    found = set()
    for path in paths:
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        found.update(re.findall(r"(/\S+\.so[.\d]*)", out))
    return found


def build_rootfs(dest: Path) -> Path:
    dest = Path(dest)
    for top in ("bin", "sbin", "lib", "lib64"):  # merged /usr, as Debian and Ubuntu lay it out
        (dest / "usr" / top).mkdir(parents=True, exist_ok=True)
        os.symlink(f"usr/{top}", dest / top)
    programs = [os.path.realpath(p) for p in (shutil.which(n, path="/usr/bin:/bin") for n in PROGRAMS) if p]
    for name in PROGRAMS:
        path = shutil.which(name, path="/usr/bin:/bin")
        if path:
            _copy("/usr/bin/" + os.path.basename(path) if path.startswith("/bin/") else path, dest)
    stdlib = os.path.realpath("/usr/lib/python3.11" if os.path.isdir("/usr/lib/python3.11")
                              else sysconfig.get_paths()["stdlib"])
    _copy(stdlib, dest)
    modules = glob.glob(os.path.join(stdlib, "lib-dynload", "*.so"))
    for lib in _libraries(programs + modules):
        _copy(lib, dest)
        _copy(os.path.realpath(lib), dest)
    site = dest / "usr" / "lib" / "python3" / "dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    for name in PYTEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        src = origin.parent if origin.name == "__init__.py" else origin
        target = site / src.name
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)
    (dest / "etc").mkdir(exist_ok=True)
    if os.path.exists("/etc/ld.so.cache"):
        shutil.copy2("/etc/ld.so.cache", dest / "etc" / "ld.so.cache")
    (dest / MARKER).parent.mkdir(parents=True, exist_ok=True)
    (dest / MARKER).write_text(MARKER_TEXT)
    subprocess.run(["chmod", "-R", "a+rX", str(dest)], check=True)
    return dest
