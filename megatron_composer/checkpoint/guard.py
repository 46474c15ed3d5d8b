"""A `--save` directory that already holds a run: refuse to train over it, or move it aside.

A run saves `iter_N` under `--save`; a second run started in the same
directory without `--load` on it would begin at iteration 0 and replace the
first run's `iter_N` one by one. Every training entry point (pretrain_cpt.py
for CPT and SFT, train_rl.py synchronous and asynchronous) calls
`guard_save_dir` before any work, and it refuses unless:

* `--load` is `--save` (resume, or the first launch of `--save D --load D`), or
* `--save` holds no checkpoint yet (no tracker, no complete `iter_N`; a
  tokenizer, logs or the debris of a killed first save do not count), or
* `--overwrite-save` is given: everything in `--save` is moved into
  `--save/overwritten-<time>/` first. Each entry moves with one rename (the
  tracker first, so a move cut short leaves no tracker naming a moved
  iteration), nothing is copied or deleted, and a later launch refuses the
  remaining iterations again until they are moved too.

Resuming automatically instead (torchtitan's choice) was not taken: a
forgotten `--load` would silently continue a run the user meant to restart,
and `--load OTHER --save D` would mix two runs' iterations in D.
"""
from __future__ import annotations

import os
import time
from typing import Optional

from .tracker import (
    OLD_SUFFIX,
    OVERWRITTEN_PREFIX,
    TRACKER,
    CheckpointError,
    complete_iterations,
    fsync_dir,
    is_complete,
)


def held_iterations(root: str) -> Optional[list[int]]:
    """The iterations a checkpoint root holds (complete `iter_N`, or `iter_N.old` of a cut re-save), or
    None when it holds no checkpoint: missing, or no tracker and no complete iteration."""
    if not os.path.isdir(root):
        return None
    its = set(complete_iterations(root))
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith(OLD_SUFFIX) and is_complete(os.path.join(root, name)):
            its.add(int(name[len("iter_"):-len(OLD_SUFFIX)]))
    if not its and not os.path.exists(os.path.join(root, TRACKER)):
        return None
    return sorted(its)


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path.startswith(root.rstrip(os.sep) + os.sep)


def move_aside(root: str, stamp: Optional[str] = None) -> str:
    """Move everything in `root` (but earlier `overwritten-*` folders) into `root/overwritten-<stamp>/`;
    returns that folder. One rename per entry, the tracker first; nothing is deleted."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    target = os.path.join(root, OVERWRITTEN_PREFIX + stamp)
    n = 1
    while os.path.exists(target):
        target = os.path.join(root, f"{OVERWRITTEN_PREFIX}{stamp}-{n}")
        n += 1
    os.mkdir(target)
    names = sorted(name for name in os.listdir(root) if not name.startswith(OVERWRITTEN_PREFIX))
    names.sort(key=lambda name: name != TRACKER)  # the tracker first (module docstring)
    for name in names:
        os.rename(os.path.join(root, name), os.path.join(target, name))
        if name == TRACKER:
            fsync_dir(root)
    fsync_dir(target)
    fsync_dir(root)
    return target


def check_save_target(save: Optional[str], load: Optional[str], overwrite_save: bool = False) -> Optional[str]:
    """The rule of the module docstring on one process: raises CheckpointError naming both fixes, or with
    `overwrite_save` moves the earlier run aside and returns where it went (None when nothing moved)."""
    if not save:
        if overwrite_save:
            raise CheckpointError("--overwrite-save needs --save: it moves the earlier run in --save aside")
        return None
    if overwrite_save and load and _same_path(load, save):
        raise CheckpointError(f"--overwrite-save with --load {load}, the --save directory itself, would move "
                              f"aside the checkpoint it loads; drop --overwrite-save to resume, or --load to "
                              f"start over")
    held = held_iterations(save)
    if held is None or (load and _same_path(load, save)):
        return None
    if overwrite_save:
        if load and _inside(load, save):
            raise CheckpointError(f"--load {load} is inside --save {save}, which --overwrite-save moves aside; "
                                  f"load from outside it or choose another --save")
        return move_aside(save)
    what = f"iterations {', '.join(map(str, held))}" if held else f"a {TRACKER}"
    started = (f"--load {load} names another checkpoint, so this run would mix its iterations with them"
               if load else "this run has no --load, so it would start at iteration 0 and replace them")
    raise CheckpointError(
        f"--save {save} already holds a checkpoint ({what}) and {started}. Pass --load {save} to resume "
        f"that run, or --overwrite-save to start over (moves its contents to {save}/{OVERWRITTEN_PREFIX}<time>/, "
        f"deleting nothing), or choose another --save")
