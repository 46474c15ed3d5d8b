"""Checkpoint directory layout: the tracker, iteration dirs, and what a path holds.

Layout of a checkpoint root (Megatron's names for the tracker and iteration dirs):

    ROOT/latest_checkpointed_iteration.txt   "120"; replaced atomically, last
    ROOT/iter_0000120/                        one complete checkpoint
    ROOT/iter_0000120.tmp/                    a save in progress (debris after a crash)
    ROOT/iter_0000120.old/                    the previous copy during a re-save of 120
    ROOT/tokenizer.model                      the tokenizer the model was trained with (copied
                                              once, at the first save; `checkpoint_tokenizer`)

An iteration dir is *complete* when it holds DCP's `.metadata` and
`meta.json`; a save renames its `.tmp` dir into place only when both (and
the checksum manifest) are written, so a dir with the final name is never
half-written. The only moment the tracker's iteration has no dir under its
final name is inside a re-save of that same iteration, between moving the
old copy to `.old` and the new one into place; readers then use `.old`
(`readable_iteration_dir`) and `remove_stale_tmp` puts it back.

`locate_checkpoint` is the one way to find a checkpoint from a path a user
gives (a root or one of its iteration dirs); training, conversion, eval and
inference all go through it.

Everything here is plain filesystem work on one process; `io` adds the
rank coordination.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import NamedTuple, Optional

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
DCP_METADATA = ".metadata"
TOKENIZER_MODEL = "tokenizer.model"
TIKTOKEN_MODEL = "tiktoken.model"  # Kimi K2.5's tokenizer, as its HF checkpoint names it
TOKENIZER_CONFIG = "tokenizer_config.json"  # its special tokens; travels with a tokenizer model beside it
HF_ASSETS = "hf_assets"  # a converted HF checkpoint's non-weight files (its tokenizer among them)
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
_ITER_DIR = re.compile(r"^iter_(\d+)$")
OVERWRITTEN_PREFIX = "overwritten-"  # earlier runs moved aside by --overwrite-save (`guard.py`)
_STALE = re.compile(r"^iter_(\d+)\.(tmp|old)$")
# what a killed first save may leave in ROOT besides iter_N.tmp
_FIRST_SAVE_DEBRIS = (TRACKER + TMP_SUFFIX, TOKENIZER_MODEL, TOKENIZER_MODEL + TMP_SUFFIX,
                      TOKENIZER_CONFIG, TOKENIZER_CONFIG + TMP_SUFFIX)


class CheckpointError(Exception):
    """A checkpoint cannot be read or written; the message names the path and the fix."""


class CheckpointSaveError(CheckpointError):
    """A save failed (I/O error, no space); the previous checkpoint is kept."""


def iteration_dir(root: str, iteration: int) -> str:
    """ROOT/iter_0000120 for iteration 120."""
    return os.path.join(root, f"iter_{iteration:07d}")


def is_complete(it_dir: str) -> bool:
    """Whether an iteration dir holds a finished save (DCP metadata and meta.json)."""
    return os.path.isfile(os.path.join(it_dir, DCP_METADATA)) and os.path.isfile(os.path.join(it_dir, META))


def _tracker_hint(root: str, exclude: Optional[int] = None) -> str:
    done = [i for i in complete_iterations(root) if i != exclude]
    if done:
        return (f"write {done[-1]} (newest complete iteration; all: {done}) into "
                f"{os.path.join(root, TRACKER)} to resume from it")
    return "no other complete iteration is left in it: start without --load or point --load elsewhere"


def complete_iterations(root: str) -> list[int]:
    """Iterations with a complete iter_N dir under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    its = []
    for name in os.listdir(root):
        m = _ITER_DIR.match(name)
        if m and is_complete(os.path.join(root, name)):
            its.append(int(m.group(1)))
    return sorted(its)


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the tracker names, or None when `root` has no tracker."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read tracker {path}: {exc}") from None
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number but holds {text[:40]!r}; "
                              f"{_tracker_hint(root)}")
    return int(text)


def readable_iteration_dir(root: str, iteration: int) -> str:
    """The complete dir holding `iteration`: iter_N, or iter_N.old inside an interrupted re-save."""
    final = iteration_dir(root, iteration)
    for candidate in (final, final + OLD_SUFFIX):
        if is_complete(candidate):
            return candidate
    state = "is incomplete (no .metadata or meta.json)" if os.path.isdir(final) else "does not exist"
    raise CheckpointError(f"checkpoint {final} {state}; {_tracker_hint(root)}")


def tracked_iteration_dir(root: str, iteration: Optional[int] = None) -> tuple[int, str]:
    """(iteration, complete dir) for `iteration`, or for the tracker's when None."""
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            what = "does not exist" if not os.path.exists(root) else f"has no {TRACKER}"
            raise CheckpointError(f"no checkpoint in {root}: it {what}; {_tracker_hint(root)}")
    return iteration, readable_iteration_dir(root, iteration)


def _read_meta_file(root: str, iteration: Optional[int], it_dir: str) -> dict:
    path = os.path.join(it_dir, META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path} ({type(exc).__name__}: {exc}); the checkpoint is "
                              f"damaged: restore the file from a copy, or {_tracker_hint(root, iteration)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a JSON {type(meta).__name__}, not an object; restore the file "
                              f"from a copy, or {_tracker_hint(root, iteration)}")
    return meta


def read_meta(root: str, iteration: Optional[int] = None) -> dict:
    """meta.json of `iteration` (default: the tracker's) under `root`."""
    iteration, it_dir = tracked_iteration_dir(root, iteration)
    return _read_meta_file(root, iteration, it_dir)


class CheckpointLocation(NamedTuple):
    """Where one iteration of a checkpoint is: its root, iteration, complete dir and meta.json."""

    root: str
    iteration: int
    dir: str
    meta: dict


def locate_checkpoint(path: str, iteration: Optional[int] = None) -> CheckpointLocation:
    """The checkpoint `path` names: a root (the tracker's iteration, or `iteration`) or one of
    its iteration dirs (iter_XXXXXXX; `iteration`, if given, must be its own).

    Raises CheckpointError naming the path and what would fit.
    """
    if os.path.isfile(os.path.join(path, META)):
        it_dir = os.path.abspath(path)
        root = os.path.dirname(it_dir)
        if not os.path.isfile(os.path.join(it_dir, DCP_METADATA)):
            raise CheckpointError(f"checkpoint {it_dir} is incomplete (no {DCP_METADATA}); "
                                  f"{_tracker_hint(root)}")
        m = re.match(r"^iter_(\d+)", os.path.basename(it_dir))
        named = int(m.group(1)) if m else None
        meta = _read_meta_file(root, named, it_dir)
        own = meta.get("iteration", named or 0)
        if isinstance(own, bool) or not isinstance(own, int):
            raise CheckpointError(f"{it_dir}/{META} names iteration {own!r:.40}, not a number; restore the file "
                                  f"from a copy")
        if iteration is not None and iteration != own:
            raise CheckpointError(f"{it_dir} holds iteration {own}, not {iteration}; pass its root "
                                  f"{root} to choose an iteration")
        return CheckpointLocation(root, own, it_dir, meta)
    if os.path.isfile(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; point at the directory "
                              f"that holds {TRACKER}")
    iteration, it_dir = tracked_iteration_dir(path, iteration)
    return CheckpointLocation(path, iteration, it_dir, _read_meta_file(path, iteration, it_dir))


def checkpoint_tokenizer(path: str) -> Optional[str]:
    """The tokenizer model a checkpoint carries, or None: `ROOT/tokenizer.model` (copied there
    by the first save of a training run), else the one a checkpoint converted from Hugging Face
    brought in `ROOT/hf_assets/` (a SentencePiece `tokenizer.model` or Kimi's `tiktoken.model`).
    `path` is a root or one of its iteration dirs."""
    if not path or not os.path.isdir(path):
        return None
    root = os.path.dirname(os.path.abspath(path)) if os.path.isfile(os.path.join(path, META)) else path
    for candidate in (os.path.join(root, TOKENIZER_MODEL), os.path.join(root, HF_ASSETS, TOKENIZER_MODEL),
                      os.path.join(root, HF_ASSETS, TIKTOKEN_MODEL)):
        if os.path.isfile(candidate):
            return candidate
    return None


def load_target_kind(path: str) -> str:
    """What a `--load` / `--save` path holds: "missing", "empty" or "checkpoint".

    "empty": an existing directory with nothing but the debris of an
    interrupted first save (`iter_*.tmp`, a tracker temp file, the tokenizer
    it copied first) and earlier runs moved aside by `--overwrite-save`
    (`overwritten-*`, `guard.py`). Anything else that is not a complete tracked checkpoint
    raises CheckpointError: a file, a directory of other files, an iteration
    dir given instead of its root, a tracker naming a missing or incomplete
    iteration.
    """
    if not os.path.exists(path):
        return "missing"
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; point at the directory "
                              "that holds latest_checkpointed_iteration.txt")
    if os.path.exists(os.path.join(path, TRACKER)):
        tracked_iteration_dir(path)
        return "checkpoint"
    names = [n for n in os.listdir(path) if not (_STALE.match(n) and n.endswith(TMP_SUFFIX))
             and n not in _FIRST_SAVE_DEBRIS and not n.startswith(OVERWRITTEN_PREFIX)]
    if not names:
        return "empty"
    if is_complete(path):
        raise CheckpointError(f"{path} is one iteration of a checkpoint; pass its parent "
                              f"{os.path.dirname(os.path.abspath(path))} (the dir with {TRACKER})")
    if complete_iterations(path):
        raise CheckpointError(f"{path} has iteration dirs but no {TRACKER}; {_tracker_hint(path)}")
    raise CheckpointError(f"{path} is not a checkpoint (no {TRACKER}; holds e.g. {sorted(names)[:3]}); "
                          "choose an empty or new directory, or the root of a checkpoint")


def is_checkpoint_dir(root: str) -> bool:
    """Whether `root` is a checkpoint whose tracker names a complete iteration."""
    try:
        return load_target_kind(root) == "checkpoint"
    except CheckpointError:
        return False


def fsync_file(path: str) -> None:
    """Flush a file's data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (renames, new files) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and all of Windows) cannot fsync a directory; files are synced
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes) -> None:
    """Replace `path` by `data` so that readers see the old or the new content, never a mix."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def copy_tokenizer(root: str, source: str) -> bool:
    """Put the tokenizer model `source` at ROOT/tokenizer.model (atomic), and the
    tokenizer_config.json beside it, if any, at ROOT/tokenizer_config.json (Kimi's tiktoken
    tokenizer names its special tokens there); a copy already there with the same bytes is
    kept. Returns whether it wrote."""
    wrote = False
    companion = os.path.join(os.path.dirname(os.path.abspath(source)), TOKENIZER_CONFIG)
    for src, name in ((source, TOKENIZER_MODEL), (companion, TOKENIZER_CONFIG)):
        if name == TOKENIZER_CONFIG and not os.path.isfile(src):
            continue
        try:
            with open(src, "rb") as f:
                data = f.read()
        except OSError as exc:
            kind = "model" if name == TOKENIZER_MODEL else "config"
            raise CheckpointError(f"cannot read the tokenizer {kind} {src} to store it with the checkpoint "
                                  f"({exc}); give an existing --tokenizer-model") from None
        target = os.path.join(root, name)
        if os.path.isfile(target):
            with open(target, "rb") as f:
                if f.read() == data:
                    continue
        write_file_atomic(target, data)
        wrote = True
    return wrote


def write_tracker(root: str, iteration: int) -> None:
    """Point the tracker at `iteration` (atomic, durable)."""
    write_file_atomic(os.path.join(root, TRACKER), str(iteration).encode())


def restore_or_drop_old(root: str, iteration: int) -> list[str]:
    """Settle iter_N.old after a re-save: back into place if iter_N is not complete, else removed.

    Returns the paths removed.
    """
    final = iteration_dir(root, iteration)
    old = final + OLD_SUFFIX
    if not os.path.exists(old):
        return []
    if not is_complete(final) and is_complete(old):
        removed = [final] if os.path.exists(final) else []
        shutil.rmtree(final, ignore_errors=True)
        os.rename(old, final)
        fsync_dir(root)
        return removed
    shutil.rmtree(old)
    return [old]


def remove_stale_local(root: str) -> list[str]:
    """Remove the debris of interrupted saves under `root` (one process).

    `iter_*.tmp` dirs and the tracker's and tokenizer's temp files are removed; an
    `iter_N.old` copy goes back into place when the re-save that moved it
    did not finish, and is removed when it did. Returns the removed paths.
    """
    if not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        m = _STALE.match(name)
        path = os.path.join(root, name)
        if m and m.group(2) == "tmp":
            shutil.rmtree(path)
            removed.append(path)
        elif m:
            removed += restore_or_drop_old(root, int(m.group(1)))
    for name in (TRACKER + TMP_SUFFIX, TOKENIZER_MODEL + TMP_SUFFIX, TOKENIZER_CONFIG + TMP_SUFFIX):
        path = os.path.join(root, name)
        if os.path.exists(path):
            os.remove(path)
            removed.append(path)
    return removed
