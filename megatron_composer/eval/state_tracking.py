"""State tracking: the model replays a sequence of edits on a file and writes the final file.

Tasks (deterministic in the source, the settings and `seed`):

- a git repository (`EvalSource.git_root`): consecutive versions of a file
  from `git log` (oldest first, renames not followed), cropped to the
  changed lines with 3 lines of context on each side; the edits are
  `edits.diff_edits(old, new)`;
- otherwise (the default corpus, a plain directory): a snippet of whole
  lines of a file, then `edits_per_task` random inserts, deletions and
  replacements (`edits.synthetic_edits`) with lines taken from the corpus.

Files (and git edit lists) longer than `max_chars` characters are not
used, so the same tasks fit any tokenizer's window at a given size; a
synthetic edit removes at most 2 lines and adds at most 2 lines of at most
80 characters. The prompt:

    Apply the edits below to the file, in order: ...
    ### File: PATH
    <file>
    ### End of file
    ### Edits
    Edit 1: replace lines 3-4
    - <old line>
    + <new line>
    ...
    ### Final file: PATH

and the model writes the file up to `### End of file` (greedy, at most
1.25 x the answer's tokens + 8, at most half the window). A prompt longer
than the rest of the window loses its first tokens (counted in
`truncated`). Score: character-level edit distance between the answer and
the true final file, raw and normalized by the longer of the two (0 is
exact, 1 shares nothing); also the fraction of exact answers and, as a
yardstick, the normalized distance of the unedited file to the truth.
"""
from __future__ import annotations

import difflib
import math
import random
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

from .edits import (Edit, apply_edits, diff_edits, edit_distance, join_lines, normalized_edit_distance,
                    render_edits, split_lines, synthetic_edits)
from .sources import EvalSource

STOP = "### End of file"
INSTRUCTIONS = ("Apply the edits below to the file, in order: each edit's line numbers refer to the file as "
                "the previous edits left it; '-' lines are removed, '+' lines are added. Then write the "
                "whole final file.")
CONTEXT_LINES = 3
MAX_POOL_LINE = 80


@dataclass(frozen=True)
class StateTask:
    path: str
    original: tuple[str, ...]  # lines
    edits: tuple[Edit, ...]
    origin: str  # "synthetic" or "git OLD..NEW"

    @property
    def truth(self) -> str:
        return join_lines(apply_edits(self.original, self.edits))

    def prompt(self) -> str:
        return (f"{INSTRUCTIONS}\n### File: {self.path}\n{join_lines(self.original)}{STOP}\n"
                f"### Edits\n{render_edits(self.edits)}### Final file: {self.path}\n")


def _snippet(lines: list[str], max_chars: int, rng: random.Random) -> Optional[list[str]]:
    """A block of at least 3 whole lines from a random start, within max_chars (None if none fits)."""
    start = rng.randrange(len(lines))
    block, size = [], 0
    for line in lines[start:]:
        if size + len(line) + 1 > max_chars:
            break
        block.append(line)
        size += len(line) + 1
    return block if len(block) >= 3 else None


def synthetic_tasks(source: EvalSource, count: int, edits_per_task: int, max_chars: int,
                    seed: int = 0) -> list[StateTask]:
    """`count` snippet + random-edit-script tasks over the source's files."""
    rng = random.Random(f"state-tracking:{seed}")
    files = [(path, split_lines(text)) for path, text in source.files]
    files = [(path, lines) for path, lines in files if len(lines) >= 3]
    pool = sorted({line.rstrip() for _, lines in files for line in lines
                   if line.strip() and len(line) <= MAX_POOL_LINE})
    tasks = []
    for _ in range(20 * count):  # files whose lines are all too long give no snippet
        if len(tasks) == count or not files:
            break
        path, lines = files[rng.randrange(len(files))]
        block = _snippet(lines, max_chars, rng)
        if block is None:
            continue
        tasks.append(StateTask(path, tuple(block), tuple(synthetic_edits(block, edits_per_task, pool, rng)),
                               "synthetic"))
    return tasks


def _git(root: str, *args: str) -> Optional[bytes]:
    out = subprocess.run(["git", "-C", root, *args], capture_output=True, timeout=120)
    return out.stdout if out.returncode == 0 else None


def file_histories(root: str, extensions: Sequence[str]) -> dict[str, list[str]]:
    """{path relative to the repository top: commits that changed it, oldest first} under `root`."""
    log = _git(root, "log", "--reverse", "--no-renames", "--format=%x00%H", "--name-only", "--", ".")
    if log is None:
        raise ValueError(f"git log failed in {root}; is it a git work tree with commits?")
    histories: dict[str, list[str]] = {}
    for entry in log.decode("utf-8", errors="replace").split("\x00")[1:]:
        commit, *paths = [line for line in entry.splitlines() if line]
        for path in paths:
            if path.endswith(tuple(extensions)):
                histories.setdefault(path, []).append(commit)
    return histories


def crop_to_change(old: list[str], new: list[str], context: int = CONTEXT_LINES) -> tuple[list[str], list[str]]:
    """The lines of `old` and `new` from `context` lines before the first change to `context` after the last."""
    ops = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not ops:
        return old, new
    first, last_old, last_new = ops[0][1], ops[-1][2], ops[-1][4]  # before `first`, both are equal
    lo, tail = max(0, first - context), min(context, len(old) - last_old)
    return old[lo:last_old + tail], new[lo:last_new + tail]


def git_tasks(source: EvalSource, count: int, max_chars: int, seed: int = 0) -> list[StateTask]:
    """`count` tasks from consecutive versions of the repository's files (see the module docstring)."""
    root = source.git_root
    prefix = (_git(root, "rev-parse", "--show-prefix") or b"").decode().strip()
    pairs = [(path, commits[i], commits[i + 1]) for path, commits in sorted(file_histories(root, source.extensions).items())
             if path.startswith(prefix) for i in range(len(commits) - 1)]
    random.Random(f"state-tracking-git:{seed}").shuffle(pairs)
    tasks = []
    for path, before, after in pairs:
        if len(tasks) == count:
            break
        texts = [_git(root, "show", f"{commit}:{path}") for commit in (before, after)]
        if None in texts:  # deleted at one end
            continue
        try:
            old, new = (split_lines(t.decode("utf-8")) for t in texts)
        except UnicodeDecodeError:
            continue
        old, new = crop_to_change(old, new)
        edits = diff_edits(old, new)
        if edits and len(join_lines(old)) <= max_chars and len(render_edits(edits)) <= max_chars:
            tasks.append(StateTask(path[len(prefix):], tuple(old), tuple(edits), f"git {before[:12]}..{after[:12]}"))
    return tasks


def build_state_tasks(source: EvalSource, count: int, edits_per_task: int, max_chars: int,
                      seed: int = 0) -> list[StateTask]:
    if source.git_root is not None:
        return git_tasks(source, count, max_chars, seed)
    return synthetic_tasks(source, count, edits_per_task, max_chars, seed)


@dataclass(frozen=True)
class StateRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    truncated: bool


def state_request(task: StateTask, tokenizer, window: int) -> StateRequest:
    """The prompt's tokens (cut from the left to fit) and the generation budget of one task."""
    answer = len(tokenizer.encode(task.truth + STOP))
    max_tokens = max(1, min(answer + answer // 4 + 8, window // 2))
    prompt = tokenizer.encode(task.prompt())
    keep = window - max_tokens
    return StateRequest(tuple(prompt[-keep:]), max_tokens, len(prompt) > keep)


def score_answer(task: StateTask, answer: str) -> dict:
    truth = task.truth
    return {"edit_distance": edit_distance(answer, truth), "normalized": normalized_edit_distance(answer, truth),
            "exact": answer == truth, "unedited": normalized_edit_distance(join_lines(task.original), truth)}


def summarize_state(tasks: Sequence[StateTask], scores: Sequence[dict], requests: Sequence[StateRequest]) -> dict:
    n = len(scores)

    def mean(key):
        return math.fsum(float(s[key]) for s in scores) / n if n else float("nan")

    return {"normalized_edit_distance": mean("normalized"), "edit_distance": mean("edit_distance"),
            "exact_match": mean("exact"), "unedited_normalized_edit_distance": mean("unedited"), "tasks": n,
            "edits": math.fsum(len(t.edits) for t in tasks) / n if n else 0.0,
            "truncated": sum(r.truncated for r in requests),
            "origin": "git" if any(t.origin.startswith("git") for t in tasks) else "synthetic"}
