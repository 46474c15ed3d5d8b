"""What the base evals read: a repository's files, in alphabetical order of path.

`EvalSource` is the text of a set of files keyed by their POSIX path
relative to a root, sorted by that path as a string (so the order is the
same on every file system). Two places it comes from:

- `held_out_source()`: the held-out split of the embedded standard-library
  corpus (`data.corpus.stdlib_corpus("valid")`), the files no stage of
  training reads: the default of every eval;
- `directory_source(root, extensions)`: every file under `root` whose name
  ends in one of `extensions`, skipping hidden directories (`.git`, ...) and
  files that do not decode as UTF-8. When `root` is inside a git work tree,
  `git_root` is set and state tracking replays the repository's history.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class EvalSource:
    """Files (relative POSIX path, text), sorted by path; `git_root` when they live in a git work tree."""

    name: str  # what the JSON and the table call the data
    files: tuple[tuple[str, str], ...]
    root: Optional[str] = None
    git_root: Optional[str] = None  # the directory git commands run in (the source's own root)
    extensions: tuple[str, ...] = (".py",)

    @property
    def python_files(self) -> list[tuple[str, str]]:
        return [(path, text) for path, text in self.files if path.endswith(".py")]

    def describe(self) -> dict:
        return {"name": self.name, "root": self.root, "files": len(self.files),
                "chars": sum(len(text) for _, text in self.files), "git": self.git_root is not None,
                "extensions": list(self.extensions)}


def held_out_source() -> EvalSource:
    """The held-out split of the embedded standard-library corpus."""
    from ..data.corpus import stdlib_corpus, stdlib_root

    root = stdlib_root()
    files = [(path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")) for path in stdlib_corpus("valid")]
    return EvalSource("stdlib held-out split", tuple(sorted(files)), str(root))


def _decoded(path: Path) -> Optional[str]:
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def git_work_tree(root: str | Path) -> bool:
    """Whether `root` is inside a git work tree (and git runs)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-inside-work-tree"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "true"


def normalize_extensions(extensions: Sequence[str]) -> tuple[str, ...]:
    return tuple(e if e.startswith(".") else f".{e}" for e in extensions if e)


def directory_source(root: str | Path, extensions: Sequence[str] = (".py",)) -> EvalSource:
    """Every UTF-8 file under `root` ending in one of `extensions` (hidden directories skipped).

    Raises ValueError for a missing directory or one with no such file."""
    root = Path(root)
    suffixes = normalize_extensions(extensions)
    if not root.is_dir():
        raise ValueError(f"--data {root} is not a directory; give a repository or source directory "
                         f"(default: the held-out split of the embedded corpus)")
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        for name in names:
            if not name.endswith(suffixes):
                continue
            path = Path(directory, name)
            text = _decoded(path)
            if text is not None and path.is_file():
                files.append((path.relative_to(root).as_posix(), text))
    if not files:
        raise ValueError(f"--data {root} has no UTF-8 files ending in {', '.join(suffixes)}; point --data at "
                         f"a source directory or pass --extensions (e.g. --extensions .py,.rs)")
    return EvalSource(str(root), tuple(sorted(files)), str(root),
                      git_root=str(root) if git_work_tree(root) else None, extensions=suffixes)
