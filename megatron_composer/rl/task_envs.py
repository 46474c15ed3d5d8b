"""Per-task Python environments for the sandbox (a task's `"requirements"`).

    requirements = parse_requirements(record.get("requirements"))   # ("numpy==1.26.4", ...)
    site = task_env_site_packages(requirements)                     # built once, then cached
    Sandbox(workspace, site_packages=site)

A task that names requirements gets its own virtual environment in place of
the host's site-packages: the sandbox binds the environment's site-packages
read-only at `sandbox.SITE_PACKAGES_MOUNT` (where the host's would go), so the
task's code imports exactly what it asked for plus pytest (the verifiers run
it), and nothing of the host's Python packages.

The environment lives under `${MC_TASK_ENV_CACHE:-~/.cache/megatron-composer/task-envs}/<hash>`,
where the hash covers the sorted requirements, the implicit `BASE_REQUIREMENTS`,
any extra pip arguments and the Python version. It is built once: under an
exclusive lock (`<hash>.lock`, so concurrent builders wait for the first one),
in a temporary directory beside it (`python -m venv --without-pip`, then this
interpreter's pip installs into it with `--python`), stamped (`STAMP`) and
renamed into place; a directory without the stamp is never used. A failed
install raises `TaskEnvError` naming the requirements and pip's last lines.

Requirements come from task files (hostile input as much as the policy's
commands), so only plain PEP 508 `name[extras] specifier ; marker` strings are
accepted: no URLs (`name @ url`), paths, pip options (`-e`, `--index-url`,
`-r`), or anything `packaging` cannot parse. The package index is pip's own
configuration; `MC_TASK_ENV_PIP_ARGS` (shell-split) or `pip_args` add options
such as `--no-index --find-links DIR` for an offline wheelhouse.

Known limits: the environment's packages must run on the sandbox's system
`python3` (same minor version as this interpreter: pure-Python and matching
binary wheels); pip runs on the host, unsandboxed, with the index's packages
(building an sdist runs its setup code on the host).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from packaging.requirements import InvalidRequirement, Requirement

BASE_REQUIREMENTS = ("pytest",)
STAMP = ".megatron-composer-task-env"
MAX_REQUIREMENTS = 64
MAX_REQUIREMENT_CHARS = 200
PIP_TIMEOUT_S = 1800.0
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-\[\], <>=!~*;'\"()]*")


class TaskEnvError(RuntimeError):
    """A task environment could not be built (pip failed); the message names the requirements and pip's output."""


def parse_requirements(value, key: str = "requirements") -> tuple[str, ...]:
    """The validated requirements of a task record (None -> ()); ValueError naming the bad entry otherwise."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise ValueError(f"{key!r} is {_short(value)}; give a non-empty list of requirement strings such as "
                         "[\"numpy==1.26.4\", \"sympy>=1.12\"], or leave it out")
    if len(value) > MAX_REQUIREMENTS:
        raise ValueError(f"{key!r} names {len(value)} requirements; at most {MAX_REQUIREMENTS} are allowed")
    out = []
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"{key!r} entry {_short(item)} is not a string; write each as \"name==version\"")
        text = item.strip()
        fix = "give a plain PEP 508 name and version specifier such as \"numpy==1.26.4\""
        if not text or len(text) > MAX_REQUIREMENT_CHARS or not _PLAIN.fullmatch(text):
            raise ValueError(f"{key!r} entry {_short(item)} is not a plain requirement (options, URLs, paths and "
                             f"control characters are refused); {fix}")
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise ValueError(f"{key!r} entry {_short(item)} does not parse ({exc}); {fix}") from None
        if req.url:
            raise ValueError(f"{key!r} entry {_short(item)} names a URL; {fix}")
        out.append(str(req))
    if len({_name(r) for r in out}) != len(out):
        raise ValueError(f"{key!r} {_short(value)} names a package twice; merge its specifiers into one entry")
    return tuple(sorted(out))


def cache_dir() -> Path:
    return Path(os.environ.get("MC_TASK_ENV_CACHE") or Path.home() / ".cache" / "megatron-composer" / "task-envs")


def env_hash(requirements: Sequence[str], pip_args: Sequence[str] = (),
             base: Sequence[str] = BASE_REQUIREMENTS) -> str:
    spec = {"requirements": sorted(requirements), "base": sorted(base), "pip_args": list(pip_args),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]


def task_env_site_packages(requirements: Sequence[str], *, pip_args: Optional[Sequence[str]] = None,
                           base: Sequence[str] = BASE_REQUIREMENTS, cache: Optional[Path] = None) -> str:
    """The site-packages of the environment holding `requirements` + `base`, built on first use."""
    requirements = parse_requirements(list(requirements)) if requirements else ()
    if pip_args is None:
        pip_args = shlex.split(os.environ.get("MC_TASK_ENV_PIP_ARGS", ""))
    root = Path(cache) if cache is not None else cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    digest = env_hash(requirements, pip_args, base)
    final = root / digest
    if not (final / STAMP).is_file():
        with open(root / f"{digest}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not (final / STAMP).is_file():
                    _build(final, list(requirements) + list(base), list(pip_args))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return str(_site_packages_of(final))


def sandbox_kwargs_for(task, sandbox_kwargs: Optional[dict] = None) -> dict:
    """`sandbox_kwargs` plus `site_packages` of `task`'s environment when it names requirements (built now),
    or its `rootfs` when it names one."""
    kwargs = dict(sandbox_kwargs or {})
    requirements, rootfs = getattr(task, "requirements", ()), getattr(task, "rootfs", "")
    if rootfs and kwargs.get("rootfs") is None:
        kwargs["rootfs"] = rootfs
    elif requirements and kwargs.get("site_packages") is None:
        kwargs["site_packages"] = task_env_site_packages(requirements)
    return kwargs


def _build(final: Path, requirements: list[str], pip_args: list[str]) -> None:
    if final.exists():  # unstamped: not built by this module (the stamp is written before the rename)
        shutil.rmtree(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from a sandbox that runs as another uid
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True,
                       capture_output=True, timeout=120)
        cmd = [sys.executable, "-m", "pip", "--python", str(tmp / "bin" / "python"), "install", "--no-input",
               "--disable-pip-version-check", "--no-warn-script-location", *pip_args, "--", *requirements]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TaskEnvError(f"pip did not install {requirements} within {PIP_TIMEOUT_S:.0f} s; check the "
                               "package index (pip config) or MC_TASK_ENV_PIP_ARGS") from None
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise TaskEnvError(f"pip could not install the task requirements {requirements} (exit code "
                               f"{proc.returncode}); fix or pin the requirement pip names below, or set "
                               f"MC_TASK_ENV_PIP_ARGS for another index:\n{tail}")
        _site_packages_of(tmp)
        (tmp / STAMP).write_text(json.dumps({"requirements": requirements, "pip_args": pip_args}) + "\n")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _site_packages_of(env: Path) -> Path:
    found = sorted(env.glob("lib/python*/site-packages"))
    if len(found) != 1:
        raise TaskEnvError(f"task environment {env} has {len(found)} site-packages directories, expected one; "
                           "delete it and retry")
    return found[0]


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
