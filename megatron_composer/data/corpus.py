"""Where training text comes from: the embedded stdlib corpus and user inputs.

The embedded default corpus is the Python standard library source of the
running interpreter, so the whole pipeline (tokenizer, CPT, SFT) runs with no
download. It is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``
except:

- ``site-packages/`` (third-party code, differs per machine),
- directories named ``test``, ``tests`` or ``idle_test`` (test suites: large,
  repetitive, and full of deliberately odd code),
- ``idlelib/`` (a GUI application) and ``lib2to3/`` (deprecated, removed in
  3.13, so keeping it would make the corpus differ most across versions),
- ``encodings/`` and ``pydoc_data/`` (generated code-page tables and one huge
  help-text string: not representative source),
- ``config-*/`` (build-configuration helpers whose directory name depends on
  the platform),
- files that do not decode as UTF-8.

On CPython 3.11 that leaves about 480 files, 9 MB of source.

The train / held-out split is a pure function of each file's path relative to
the stdlib root (``sha1`` of the POSIX path), so it is the same on every
machine with the same Python version and does not depend on directory
listing order: a file is held out iff the first 8 hex digits of its hash,
mod 1000, are below 20 (about 2%).

User inputs (``tools/train_tokenizer.py --input``, ``tools/preprocess_data.py
--input``) are files, directories (searched recursively by extension) and
JSONL files (``.jsonl``/``.json``, one JSON object per line, text under a
key); ``expand_inputs`` and ``iter_texts`` are the one place that reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "encodings", "pydoc_data"}
)
HELD_OUT_PER_MILLE = 20
JSONL_SUFFIXES = (".jsonl", ".json")


def stdlib_root() -> Path:
    """Directory holding the running interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """Whether a stdlib file (POSIX path relative to the stdlib root) is in the valid split."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 1000 < HELD_OUT_PER_MILLE


def _is_excluded_dir(relative_dir: tuple[str, ...]) -> bool:
    if relative_dir and relative_dir[-1] in EXCLUDED_DIRS:
        return True
    return len(relative_dir) == 1 and relative_dir[0].startswith("config-")


def _decodes_as_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def stdlib_corpus(split: str = "train", root: Path | None = None) -> list[Path]:
    """Sorted absolute paths of the stdlib corpus files in ``split``.

    Args:
        split: ``"train"`` (about 98% of files) or ``"valid"`` (about 2%).
        root: stdlib directory; defaults to the running interpreter's.
    """
    if split not in ("train", "valid"):
        raise ValueError(f"split {split!r} is not a corpus split; use 'train' or 'valid'")
    root = stdlib_root() if root is None else Path(root)
    want_held_out = split == "valid"
    files = []
    for directory, subdirs, names in os.walk(root):
        relative_dir = Path(directory).relative_to(root).parts
        # prune in place so os.walk never descends into excluded trees (site-packages is large)
        subdirs[:] = [d for d in subdirs if not _is_excluded_dir(relative_dir + (d,))]
        for name in names:
            if not name.endswith(".py"):
                continue
            relative = "/".join(relative_dir + (name,))
            path = Path(directory, name)
            if is_held_out(relative) == want_held_out and path.is_file() and _decodes_as_utf8(path):
                files.append((relative, path))
    return [path for _, path in sorted(files)]


def module_name(path: Path, root: Path | None = None) -> str:
    """Dotted module name of a stdlib file, e.g. ``json.decoder`` or ``os``."""
    root = stdlib_root() if root is None else Path(root)
    try:
        parts = list(Path(path).relative_to(root).with_suffix("").parts)
    except ValueError:
        parts = [Path(path).stem]
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_jsonl(path: Path) -> bool:
    return Path(path).suffix in JSONL_SUFFIXES


def expand_inputs(inputs: Sequence[str | Path], extensions: Sequence[str] = (".py",)) -> list[Path]:
    """Files named by ``inputs``: files as given, directories searched recursively.

    Directories contribute files whose suffix is in ``extensions`` (sorted, so
    the document order does not depend on the file system); named files are
    kept whatever their suffix, in the order given.
    """
    suffixes = tuple(e if e.startswith(".") else f".{e}" for e in extensions)
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
            if not found:
                raise FileNotFoundError(
                    f"input directory {path} has no files with extensions {list(suffixes)}; "
                    "pass --extensions or a different --input"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist; check the --input path")
    return files


def jsonl_records(path: str | Path, fix: str = "write one JSON object per line") -> Iterator[tuple[int, object]]:
    """(1-based line number, parsed value) for every non-blank line of a JSONL file.

    A line that is not JSON raises ``ValueError`` ``path:line: invalid JSON
    (reason at column c); <fix>``."""
    path = Path(path)
    with path.open(encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: invalid JSON ({error.msg} at column {error.colno}); {fix}"
                ) from None


def iter_texts(files: Iterable[str | Path], json_key: str = "text") -> Iterator[str]:
    """One text per source file, or one per line of a JSONL file (``line[json_key]``).

    Source files that are not UTF-8 are skipped with a note on stderr, like
    the stdlib corpus; a JSONL line without ``json_key`` is an error naming
    the file and line.
    """
    for item in files:
        path = Path(item)
        if is_jsonl(path):
            for number, record in jsonl_records(path, "fix or drop that line"):
                if not isinstance(record, dict) or json_key not in record:
                    raise KeyError(
                        f"{path}:{number} has no key {json_key!r} "
                        f"(keys: {sorted(record) if isinstance(record, dict) else 'not an object'}); "
                        "pass --json-key with the field that holds the text"
                    )
                yield record[json_key]
        else:
            try:
                yield path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                print(f"skipping {path}: not UTF-8", file=sys.stderr)


def count_texts(files: Sequence[str | Path]) -> int:
    """Upper bound on what ``iter_texts`` yields (for progress bars): files plus JSONL lines."""
    total = 0
    for item in files:
        path = Path(item)
        if is_jsonl(path):
            with path.open("rb") as stream:
                total += sum(1 for line in stream if line.strip())
        else:
            total += 1
    return total
