"""Line edits of a file: apply, render as text, derive from two versions, generate; edit distance.

An `Edit` is one hunk in the current state of the file: at 1-based line
`line`, the lines `remove` (which must be there) become `add`. An empty
`remove` is an insertion before `line` (`line` = number of lines + 1
appends), an empty `add` a deletion. Edits apply in order, each to the file
the previous ones left, so line numbers move as the file changes: that
bookkeeping is what the state-tracking eval asks of the model.

Files are lists of lines: `split_lines(text)` drops one final newline and
splits on "\\n"; `join_lines(lines)` puts it back, so every file ends in
exactly one newline.

`diff_edits(old, new)` turns two versions (consecutive commits of a file)
into edits with difflib's matching blocks, emitted bottom-up so that each
edit's line number in the current state equals its line number in `old`;
`synthetic_edits` writes seeded random edit scripts over a file.

Edit distance is rapidfuzz's Levenshtein distance over characters (unit
cost insert / delete / substitute), a C++ implementation: our own O(n m)
Python loop would take seconds per answer for files of a few KB.
"""
from __future__ import annotations

import difflib
import random
from dataclasses import dataclass
from typing import Sequence

from rapidfuzz.distance import Levenshtein


@dataclass(frozen=True)
class Edit:
    """Lines `remove` at 1-based `line` of the current file become `add`."""

    line: int
    remove: tuple[str, ...] = ()
    add: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return "insert" if not self.remove else "delete" if not self.add else "replace"


def split_lines(text: str) -> list[str]:
    if text.endswith("\n"):
        text = text[:-1]
    return text.split("\n") if text else []


def join_lines(lines: Sequence[str]) -> str:
    return "".join(line + "\n" for line in lines)


def apply_edits(lines: Sequence[str], edits: Sequence[Edit]) -> list[str]:
    """`lines` after every edit in order; ValueError when an edit's `remove` is not at its line."""
    out = list(lines)
    for number, edit in enumerate(edits, 1):
        start = edit.line - 1
        if not 0 <= start <= len(out) or out[start:start + len(edit.remove)] != list(edit.remove):
            raise ValueError(f"edit {number} ({edit.kind} at line {edit.line}) does not match the file: "
                             f"expected {list(edit.remove)!r} there, the file has {len(out)} lines")
        out[start:start + len(edit.remove)] = edit.add
    return out


def render_edit(number: int, edit: Edit) -> str:
    """`Edit 2: replace lines 3-4` then `- ` removed lines and `+ ` added lines."""
    if edit.remove:
        last = edit.line + len(edit.remove) - 1
        where = f"line {edit.line}" if last == edit.line else f"lines {edit.line}-{last}"
    else:
        where = f"at line {edit.line}"
    body = [f"- {line}" for line in edit.remove] + [f"+ {line}" for line in edit.add]
    return "\n".join([f"Edit {number}: {edit.kind} {where}"] + body) + "\n"


def render_edits(edits: Sequence[Edit]) -> str:
    return "".join(render_edit(i, e) for i, e in enumerate(edits, 1))


def diff_edits(old: Sequence[str], new: Sequence[str]) -> list[Edit]:
    """Edits that turn `old` into `new` (difflib opcodes, bottom-up; see the module docstring)."""
    matcher = difflib.SequenceMatcher(None, list(old), list(new), autojunk=False)
    edits = [Edit(i1 + 1, tuple(old[i1:i2]), tuple(new[j1:j2]))
             for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]
    return edits[::-1]


def synthetic_edits(lines: Sequence[str], count: int, pool: Sequence[str], rng: random.Random,
                    max_span: int = 2) -> list[Edit]:
    """`count` random edits applied in sequence: insert, delete or replace 1..`max_span` lines,
    new lines drawn from `pool`; a deletion is never drawn when it would empty the file."""
    if not pool:
        raise ValueError("synthetic edits need a non-empty pool of lines to insert")
    current, edits = list(lines), []
    for _ in range(count):
        kinds = ["insert", "replace", "delete"] if len(current) > 1 else ["insert"]
        kind = rng.choice(kinds)
        added = tuple(rng.choice(pool) for _ in range(rng.randint(1, max_span)))
        if kind == "insert":
            edit = Edit(rng.randint(1, len(current) + 1), (), added)
        else:
            span = rng.randint(1, min(max_span, len(current) - (kind == "delete")))
            start = rng.randint(1, len(current) - span + 1)
            edit = Edit(start, tuple(current[start - 1:start - 1 + span]), added if kind == "replace" else ())
        current = apply_edits(current, [edit])
        edits.append(edit)
    return edits


def edit_distance(a: str, b: str) -> int:
    """Character-level Levenshtein distance (unit costs)."""
    return Levenshtein.distance(a, b)


def normalized_edit_distance(a: str, b: str) -> float:
    """`edit_distance(a, b) / max(len(a), len(b))` in [0, 1]; 0.0 for two empty strings."""
    return Levenshtein.normalized_distance(a, b)
