"""swe: SWE-style repository tasks read from a JSONL file (`--swe-task-file`).

    tasks, problems = load_swe_tasks("data/swe.jsonl")

One instance a line, in the SWE-bench / SWE-Gym fields:

    {"instance_id": str,
     "repo_dir": str,          a directory, or a .tar / .tar.gz / .tgz archive whose members are
                               repository-relative (`tar -C repo -czf repo.tar.gz .`); a relative path
                               is resolved against the file's folder, and it must lie inside that folder
     "base_commit": str,       optional: repo_dir is a git repository, the workspace is that commit
     "problem_statement": str, the instruction the model gets
     "FAIL_TO_PASS": [str],    pytest node ids ("tests/test_x.py::test_y") the fix must make pass
     "PASS_TO_PASS": [str],    node ids that pass before and must still pass
     "test_cmd": str,          optional, default "pytest": pytest with extra options
     "patch": str,             optional: the reference fix as a unified diff (scripted trajectories, tests)
     "requirements": [str],    optional: PEP 508 strings ("attrs==23.2.0"); the episode's and the verifier's
                               sandboxes mount a cached per-task environment of them instead of the host's
                               site-packages (rl/task_envs.py)
     "rootfs": str}            optional, instead of requirements: the absolute path of a root filesystem whose
                               system, python3 and pytest both sandboxes run instead of the host's

(The two lists may also be JSON-encoded strings, as some SWE-bench exports
store them.) The workspace is the repository's files (without `.git`); the
pristine tests are every file under the directories of the named test files
plus every `conftest.py`, restored before verification (`verify.py`).
Verification runs the named test files with pytest in the sandbox and reads
each node id's outcome (a plugin records them; skipped counts as failed,
xfail as passed, an id never reported as failed). The verdict follows the
SWE-bench convention: resolved = every FAIL_TO_PASS id passes and every
PASS_TO_PASS id still passes, which is `all_pass`; `correctness` is the
fraction of all named ids passing, and the FAIL_TO_PASS and PASS_TO_PASS
fractions are reported beside it.

A bad instance is never dropped silently: it becomes `path:line: problem;
fix` in the returned problems (counted by the caller); a file with none valid
is an error. Refused: lines over MAX_LINE_BYTES, repo_dir outside the file's
folder (`..`, absolute paths elsewhere, links out), archive members or git
paths that are absolute or hold `..`, symlinks whose target leaves the
repository, devices, submodules, files that are not UTF-8, repositories over
MAX_REPO_BYTES or MAX_REPO_FILES, test ids whose file is not a relative path
to a test file of the repository, and test commands that are not pytest.
Without --swe-task-file the family reads the embedded set
(rl/tasks/examples/swe: a tiny package with four injected bugs).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import posixpath
import re
import secrets
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Optional

from ...sandbox import Sandbox
from ...task_envs import sandbox_kwargs_for
from ..task_files import BadRecord, _jsonl_records, _short, read_valid, task_requirements, task_rootfs
from .task import CACHE_DIRS, CACHE_SUFFIXES, CodingTask, Edit, solved_files
from .verify import TestVerdict, _is_test_file, _read_regular, _tail, copy_workspace, write_over

FAMILY = "swe"
DESCRIPTION = "resolve a repository issue (SWE-bench style, --swe-task-file): FAIL_TO_PASS pass, PASS_TO_PASS kept"
EMBEDDED = Path(__file__).resolve().parent.parent / "examples" / "swe" / "tasks.jsonl"

MAX_REPO_BYTES = 16 << 20
MAX_REPO_FILES = 5000
MAX_ID_CHARS = 1000
MAX_LINK_HOPS = 20
COMMIT = re.compile(r"[0-9a-fA-F]{4,40}")
HUNK = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
PYTEST_PREFIXES = (("pytest",), ("python", "-m", "pytest"), ("python3", "-m", "pytest"))
REFUSED_OPTIONS = ("--junitxml", "--junit-xml", "--rootdir", "--collect-only", "--co", "--pyargs", "--confcutdir")

# The launcher of `verify.LAUNCHER` plus a plugin that records each node id's outcome (REPORT is
# replaced by the report's random name): passed when its call passed or xfailed and no phase failed.
LAUNCHER = """\
import sys
del sys.path[0]
import json
import os
import pytest


class Outcomes:
    def __init__(self):
        self.passed, self.failed = set(), set()

    def pytest_sessionstart(self, session):
        sys.path.insert(0, os.getcwd())

    def pytest_runtest_logreport(self, report):
        xfail = report.skipped and hasattr(report, "wasxfail")
        if report.failed or (report.skipped and not xfail):
            self.failed.add(report.nodeid)
        elif report.when == "call":
            self.passed.add(report.nodeid)

    def pytest_sessionfinish(self, session):
        with open(REPORT, "w") as f:
            json.dump(sorted(self.passed - self.failed), f)


raise SystemExit(pytest.main(sys.argv[1:], plugins=[Outcomes()]))
"""


@dataclasses.dataclass(frozen=True)
class SweTask(CodingTask):
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    test_args: tuple[str, ...] = ()  # test_cmd's options after "pytest"
    origin: str = ""  # path:line of its instance
    requirements: tuple[str, ...] = ()  # its own environment's packages (rl/task_envs.py); () = the host's
    rootfs: str = ""  # its own root filesystem (`Sandbox(rootfs=)`); "" = the host's system


@dataclasses.dataclass(frozen=True)
class SweVerdict(TestVerdict):
    """Counts over FAIL_TO_PASS + PASS_TO_PASS ids (so `all_pass` is "resolved"), and each list's share."""

    fail_to_pass_passed: int = 0
    fail_to_pass_total: int = 0
    pass_to_pass_passed: int = 0
    pass_to_pass_total: int = 0

    @property
    def resolved(self) -> bool:
        return self.all_pass

    @property
    def fail_to_pass(self) -> float:
        return self.fail_to_pass_passed / self.fail_to_pass_total if self.fail_to_pass_total else 1.0

    @property
    def pass_to_pass(self) -> float:
        return self.pass_to_pass_passed / self.pass_to_pass_total if self.pass_to_pass_total else 1.0


# ---------------------------------------------------------------- reading repositories

def _relative(path: str, what: str) -> str:
    """`path` as a normalized repository-relative POSIX path; BadRecord when absolute or leaving the root."""
    if not path or "\\" in path or "\0" in path or PurePosixPath(path).is_absolute():
        raise BadRecord(f"{what} {_short(path)} is not a relative path inside the repository; fix or remove it")
    parts = [p for p in PurePosixPath(path).parts if p != "."]
    if not parts or ".." in parts:
        raise BadRecord(f"{what} {_short(path)} leaves the repository ('..'); fix or remove it")
    return "/".join(parts)


def _skipped(rel: str) -> bool:
    parts = rel.split("/")
    return parts[0] == ".git" or any(p in CACHE_DIRS for p in parts[:-1]) or rel.endswith(CACHE_SUFFIXES)


class _Entries:
    """A repository being read: files (bytes) and symlinks (targets), with the size and count limits."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.links: dict[str, str] = {}
        self.size = 0

    def add_file(self, rel: str, data: bytes) -> None:
        self.size += len(data)
        if self.size > MAX_REPO_BYTES or len(self.files) >= MAX_REPO_FILES:
            raise BadRecord(f"the repository is over {MAX_REPO_BYTES} bytes or {MAX_REPO_FILES} files; "
                            "use a smaller repository")
        self.files[rel] = data

    def text_files(self) -> dict[str, str]:
        """Every file as text, each symlink replaced by a copy of the file it names inside the repository."""
        files = dict(self.files)
        for rel in self.links:
            files[rel] = self._resolve(rel)
        out = {}
        for rel, data in sorted(files.items()):
            try:
                out[rel] = data.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRecord(f"file {_short(rel)} is not UTF-8 text; remove it from the repository "
                                "(binary files are not supported)") from None
        return out

    def _resolve(self, rel: str) -> bytes:
        current = rel
        for _ in range(MAX_LINK_HOPS):
            target = self.links[current]
            joined = posixpath.normpath(posixpath.join(posixpath.dirname(current), target))
            if target.startswith("/") or joined == ".." or joined.startswith("../"):
                raise BadRecord(f"symlink {_short(rel)} -> {_short(target)} points outside the repository; "
                                "replace it by the file")
            if joined in self.files:
                return self.files[joined]
            if joined not in self.links:
                raise BadRecord(f"symlink {_short(rel)} -> {_short(target)} does not name a file of the "
                                "repository (directory links are not supported); replace it by the file")
            current = joined
        raise BadRecord(f"symlink {_short(rel)} is part of a chain of over {MAX_LINK_HOPS} links; replace it")


def _read_directory(root: Path) -> _Entries:
    entries = _Entries()
    for dirpath, dirnames, filenames in os.walk(root):  # never descends into linked directories
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames):
            full = os.path.join(dirpath, name)
            rel = PurePosixPath(os.path.normpath(os.path.join(rel_dir, name))).as_posix()
            if name in CACHE_DIRS or rel == ".git":
                dirnames.remove(name)
            elif os.path.islink(full):
                dirnames.remove(name)
                entries.links[rel] = os.readlink(full)
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = PurePosixPath(os.path.normpath(os.path.join(rel_dir, name))).as_posix()
            if _skipped(rel):
                continue
            if os.path.islink(full):
                entries.links[rel] = os.readlink(full)
                continue
            data = _read_regular(full, MAX_REPO_BYTES)
            if data is None:
                raise BadRecord(f"{_short(rel)} is not a regular file (a device, socket or fifo); remove it")
            entries.add_file(rel, data)
    return entries


def _read_tarball(path: Path) -> _Entries:
    entries = _Entries()
    try:
        with tarfile.open(path, "r:*") as archive:
            for count, member in enumerate(archive, 1):
                if count > 4 * MAX_REPO_FILES:
                    raise BadRecord(f"the archive has over {4 * MAX_REPO_FILES} members; use a smaller repository")
                if member.isdir():
                    continue
                rel = _relative(member.name, "archive member")
                if _skipped(rel):
                    continue
                if member.issym():
                    entries.links[rel] = member.linkname
                elif member.islnk():  # a hard link names another member, from the archive's root
                    target = _relative(member.linkname, "hard link target")
                    entries.links[rel] = "/".join([".."] * rel.count("/") + [target])
                elif member.isreg():
                    if member.size > MAX_REPO_BYTES:
                        raise BadRecord(f"archive member {_short(rel)} is over {MAX_REPO_BYTES} bytes; remove it")
                    entries.add_file(rel, archive.extractfile(member).read())
                else:
                    raise BadRecord(f"archive member {_short(rel)} is a device or fifo; remove it")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BadRecord(f"repo_dir {str(path)!r} is not a readable tar archive ({exc}); re-create it") from None
    return entries


def _git(repo: Path, *args: str, stdin: Optional[bytes] = None) -> bytes:
    """A git plumbing command in `repo`, with no user or system configuration and no hooks."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, "HOME": os.devnull, "GIT_TERMINAL_PROMPT": "0"}
    result = subprocess.run(["git", "-c", "core.fsmonitor=false", "-c", f"safe.directory={repo}", "-C", str(repo),
                             *args], input=stdin, capture_output=True, env=env, timeout=120)
    if result.returncode != 0:
        raise BadRecord(f"git {args[0]} in {str(repo)!r} failed ({result.stderr.decode(errors='replace').strip()}); "
                        "check base_commit and the repository")
    return result.stdout


def _read_commit(repo: Path, commit: str) -> _Entries:
    if not COMMIT.fullmatch(commit):
        raise BadRecord(f"base_commit {_short(commit)} is not a commit hash (4-40 hex digits); give the hash")
    if not (repo / ".git").exists():
        raise BadRecord(f"base_commit given but repo_dir {str(repo)!r} is not a git repository (no .git); "
                        "drop base_commit or point repo_dir at the repository")
    sha = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").decode().strip()
    listing = [line for line in _git(repo, "ls-tree", "-r", "-z", "--full-tree", sha).split(b"\0") if line]
    entries, wanted = _Entries(), []
    for line in listing:
        meta, _, raw = line.partition(b"\t")
        mode, kind, blob = meta.decode().split()
        rel = _relative(raw.decode("utf-8", "replace"), "git path")
        if kind == "commit":
            raise BadRecord(f"{_short(rel)} is a submodule, which is not supported; vendor its files")
        if not _skipped(rel):
            wanted.append((rel, mode, blob))
    if len(wanted) > MAX_REPO_FILES:
        raise BadRecord(f"the repository has over {MAX_REPO_FILES} files at {commit}; use a smaller repository")
    out = _git(repo, "cat-file", "--batch", stdin="".join(f"{blob}\n" for _, _, blob in wanted).encode())
    pos = 0
    for rel, mode, _ in wanted:  # "<sha> blob <size>\n<content>\n" per object, in order
        header_end = out.index(b"\n", pos)
        size = int(out[pos:header_end].split()[2])
        data = out[header_end + 1:header_end + 1 + size]
        pos = header_end + 2 + size
        if mode == "120000":
            entries.links[rel] = data.decode("utf-8", "replace")
        else:
            entries.add_file(rel, data)
    return entries


def _repo_files(record: dict, folder: Path) -> dict[str, str]:
    repo_dir = record.get("repo_dir")
    if not isinstance(repo_dir, str) or not repo_dir or "\0" in repo_dir:
        raise BadRecord(f"'repo_dir' is {_short(repo_dir)}; give the repository's directory or tarball")
    resolved = Path(os.path.realpath(folder / repo_dir))
    if not resolved.is_relative_to(os.path.realpath(folder)):
        raise BadRecord(f"repo_dir {_short(repo_dir)} lies outside the task file's folder {str(folder)!r}; put the "
                        "repositories in that folder (or below it) and name them relative to it")
    commit = record.get("base_commit")
    if commit is not None and not isinstance(commit, str):
        raise BadRecord(f"'base_commit' is {_short(commit)}; give the commit hash as a string")
    if not resolved.exists():
        raise BadRecord(f"repo_dir {_short(repo_dir)} does not exist (resolved to {str(resolved)!r}); fix the path")
    if commit:
        entries = _read_commit(resolved, commit)
    elif resolved.is_dir():
        entries = _read_directory(resolved)
    elif resolved.name.endswith((".tar", ".tar.gz", ".tgz")):
        entries = _read_tarball(resolved)
    else:
        raise BadRecord(f"repo_dir {_short(repo_dir)} is neither a directory nor a .tar/.tar.gz/.tgz archive")
    files = entries.text_files()
    if not files:
        raise BadRecord(f"repo_dir {_short(repo_dir)} holds no files; fix the path")
    return files


# ---------------------------------------------------------------- fields

def _test_ids(record: dict, key: str, files: dict[str, str], *, required: bool) -> tuple[str, ...]:
    value = record.get(key)
    if isinstance(value, str):  # some SWE-bench exports store the list JSON-encoded
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if value is None and not required:
        value = []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (required and not value):
        raise BadRecord(f"{key!r} is {_short(value)}; give a {'non-empty ' if required else ''}list of pytest "
                        "node ids like \"tests/test_x.py::test_y\"")
    for test_id in value:
        path, sep, name = test_id.partition("::")
        if not sep or not name or len(test_id) > MAX_ID_CHARS or not test_id.isprintable():
            raise BadRecord(f"{key} id {_short(test_id)} is not a pytest node id \"path.py::name\" of at most "
                            f"{MAX_ID_CHARS} printable characters; fix the id")
        rel = _relative(path, f"{key} id's file")
        if rel != path or rel not in files or not PurePosixPath(rel).name.endswith(".py"):
            raise BadRecord(f"{key} id {_short(test_id)} names {_short(path)}, which is not a test file of the "
                            "repository (a normalized relative path); fix the id")
    if len(set(value)) != len(value):
        raise BadRecord(f"{key!r} lists an id twice; list each once")
    return tuple(value)


def _test_args(record: dict) -> tuple[str, ...]:
    cmd = record.get("test_cmd", "pytest")
    if not isinstance(cmd, str) or len(cmd) > 500 or not cmd.isprintable():
        raise BadRecord(f"'test_cmd' is {_short(cmd)}; give a pytest command line of at most 500 characters")
    try:
        words = shlex.split(cmd)
    except ValueError as exc:
        raise BadRecord(f"'test_cmd' {_short(cmd)} does not split into words ({exc}); fix its quoting") from None
    prefix = next((p for p in PYTEST_PREFIXES if tuple(words[:len(p)]) == p), None)
    if prefix is None:
        raise BadRecord(f"'test_cmd' {_short(cmd)} is not pytest; tests run as \"pytest [options]\" (the test ids "
                        "come from FAIL_TO_PASS and PASS_TO_PASS)")
    args = tuple(words[len(prefix):])
    for arg in args:
        if arg.startswith(REFUSED_OPTIONS) or not arg.startswith("-") and ("/" in arg or ".." in arg):
            raise BadRecord(f"'test_cmd' option {_short(arg)} changes which tests run or where results go; drop it "
                            "(the test ids come from FAIL_TO_PASS and PASS_TO_PASS)")
    return args


def _patch_edits(patch: str, files: dict[str, str]) -> tuple[Edit, ...]:
    """The `Edit`s of a unified diff: per hunk, its old lines replaced by its new lines (new files written whole)."""
    edits, path, new_file = [], None, False
    lines = patch.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            new_file = line[4:].strip() == "/dev/null"
        elif line.startswith("+++ "):
            name = line[4:].strip().split("\t")[0]
            if name == "/dev/null":
                raise BadRecord("'patch' deletes a file, which is not supported; leave the file empty instead")
            path = _relative(name[2:] if name.startswith("b/") else name, "patched file")
        elif line.startswith("@@"):
            header = HUNK.match(line)
            if path is None or header is None:
                raise BadRecord(f"'patch' has a malformed hunk header {_short(line.strip())}; give a unified diff")
            old_left, new_left = (int(n) if n is not None else 1 for n in header.group(1, 2))
            old, new = [], []
            i += 1
            while (old_left or new_left) and i < len(lines):
                body, kind = lines[i][1:], lines[i][:1]
                i += 1
                if kind == "\\":  # "\ No newline at end of file"
                    continue
                if kind not in (" ", "-", "+"):
                    raise BadRecord(f"'patch' hunk line {_short(lines[i - 1])} has no ' ', '-' or '+'; give a unified diff")
                if kind != "+":
                    old.append(body)
                    old_left -= 1
                if kind != "-":
                    new.append(body)
                    new_left -= 1
            edits.append(Edit(path, None if new_file else "".join(old), "".join(new)))
            continue
        i += 1
    if not edits:
        raise BadRecord("'patch' holds no hunk; give a unified diff (git diff) or drop it")
    return tuple(edits)


def _instance(record: dict, folder: Path, where: str) -> SweTask:
    iid = record.get("instance_id")
    if not isinstance(iid, str) or not iid.strip() or len(iid) > 200 or not iid.isprintable():
        raise BadRecord(f"'instance_id' is {_short(iid)}; give a printable string of at most 200 characters")
    statement = record.get("problem_statement")
    if not isinstance(statement, str) or not statement.strip():
        raise BadRecord(f"'problem_statement' is {_short(statement)}; give the issue text the model is to resolve")
    files = _repo_files(record, folder)
    fail_to_pass = _test_ids(record, "FAIL_TO_PASS", files, required=True)
    pass_to_pass = _test_ids(record, "PASS_TO_PASS", files, required=False)
    if set(fail_to_pass) & set(pass_to_pass):
        raise BadRecord(f"{_short(sorted(set(fail_to_pass) & set(pass_to_pass))[0])} is in both FAIL_TO_PASS and "
                        "PASS_TO_PASS; keep it in one")
    test_files = {i.partition("::")[0] for i in fail_to_pass + pass_to_pass}
    test_dirs = {posixpath.dirname(p) for p in test_files}
    tests = {rel: text for rel, text in files.items()
             if rel in test_files or PurePosixPath(rel).name == "conftest.py"
             or any(d and rel.startswith(d + "/") for d in test_dirs)
             or ("" in test_dirs and "/" not in rel and _is_test_file(rel))}  # verification drops those too
    requirements = task_requirements(record)
    patch = record.get("patch")
    if patch is not None and not isinstance(patch, str):
        raise BadRecord(f"'patch' is {_short(patch)}; give the reference fix as a unified diff string or drop it")
    task = SweTask(key=f"{FAMILY}/{iid}", family=FAMILY, instruction=statement, files=files, tests=tests,
                   solution=_patch_edits(patch, files) if patch else (), reads=(), test_timeout_s=60.0,
                   fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass, test_args=_test_args(record), origin=where,
                   requirements=requirements, rootfs=task_rootfs(record))
    if task.solution:
        try:
            solved_files(task)
        except ValueError as exc:
            raise BadRecord(f"'patch' does not apply to the repository ({exc}); regenerate it at base_commit") from None
    return task


@functools.lru_cache(maxsize=8)
def load_swe_tasks(path: str | Path) -> tuple[tuple[SweTask, ...], tuple[str, ...]]:
    """(the valid instances in file order, a `path:line: problem; fix` for every bad one); ValueError when
    none is valid (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--swe-task-file {str(path)!r} is not a file; give a JSONL file of SWE instances")
    folder = path.resolve().parent
    tasks, problems = read_valid(_jsonl_records(path), lambda record, where: _instance(record, folder, where),
                                 lambda task: task.key[len(FAMILY) + 1:], noun="instance", key_name="instance_id")
    if not tasks:
        shown = "\n  ".join(problems[:5]) or "(no instances)"
        raise ValueError(f"--swe-task-file {str(path)!r} has no valid instance; {len(problems)} bad instance(s), "
                         f"the first:\n  {shown}")
    return tuple(tasks), tuple(problems)


def generate(task_file: Optional[str] = None) -> list[SweTask]:
    """The valid instances of `task_file` (default: the embedded set)."""
    return list(load_swe_tasks(str(Path(task_file or EMBEDDED).resolve()))[0])


def problems_of(task_file: Optional[str] = None) -> tuple[str, ...]:
    """The bad instances of `task_file` (default: the embedded set), as `path:line: problem; fix`."""
    return load_swe_tasks(str(Path(task_file or EMBEDDED).resolve()))[1]


# ---------------------------------------------------------------- verification

def run_swe_tests(task: SweTask, workspace: Path, *, sandbox_kwargs: Optional[dict] = None) -> SweVerdict:
    """Run the test files of `task`'s ids on a sandboxed copy of `workspace` (pristine tests restored, as
    `verify.run_tests` does) and count FAIL_TO_PASS and PASS_TO_PASS (module docstring)."""
    kwargs = sandbox_kwargs_for(task, {"timeout_s": task.test_timeout_s, **(sandbox_kwargs or {})})
    root = Path(tempfile.mkdtemp(prefix="swe-verify-"))
    try:
        notes = copy_workspace(task, Path(workspace), root)
        for rel, text in task.tests.items():
            write_over(root, rel, text)
        report = f".report-{secrets.token_hex(8)}.json"
        test_files = sorted({i.partition("::")[0] for i in task.fail_to_pass + task.pass_to_pass})
        cmd = ["python3", "-c", LAUNCHER.replace("REPORT", repr(report)), "-q", "-p", "no:cacheprovider",
               "--tb=short", "--rootdir=.", *task.test_args, *test_files]
        result = Sandbox(root, **kwargs).run(cmd)
        output = result.stdout + (("\n" + result.stderr) if result.stderr.strip() else "")
        if notes:
            shown = ", ".join(notes[:10]) + ("" if len(notes) <= 10 else ", ...")
            output = f"not copied for verification: {shown}\n{output}"
        passed: set[str] = set()
        data = None if result.timed_out else _read_regular(str(root / report), 8 << 20)
        if data:
            try:
                listed = json.loads(data)
                passed = {i for i in listed if isinstance(i, str)} if isinstance(listed, list) else set()
            except (json.JSONDecodeError, RecursionError, UnicodeDecodeError):
                pass
        f2p = sum(i in passed for i in task.fail_to_pass)
        p2p = sum(i in passed for i in task.pass_to_pass)
        total = len(task.fail_to_pass) + len(task.pass_to_pass)
        head = (f"FAIL_TO_PASS {f2p}/{len(task.fail_to_pass)} passed, PASS_TO_PASS {p2p}/{len(task.pass_to_pass)} "
                "passed" + (" (timed out)" if result.timed_out else ""))
        return SweVerdict(passed=f2p + p2p, failed=total - f2p - p2p, errors=0, total=total,
                          output=_tail(head + "\n" + output), timed_out=result.timed_out,
                          fail_to_pass_passed=f2p, fail_to_pass_total=len(task.fail_to_pass),
                          pass_to_pass_passed=p2p, pass_to_pass_total=len(task.pass_to_pass))
    finally:
        shutil.rmtree(root, ignore_errors=True)
