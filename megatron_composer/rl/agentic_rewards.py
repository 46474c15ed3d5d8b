"""Behaviour reward values of one agent trajectory: style, communication, tool use.

Pure functions of what a trajectory left behind; the agentic environment
(`rl.agentic`) puts their values in the sample's verdict, and the reward terms
of the same names (`rewards.REWARD_TERMS`) read them from there:

    style           style_score(changed_files(task files, workspace)): -(issues), 0 is clean
    communication   communication_score(final message): 1.0 for a present message of sensible length
    tool_misuse     tool_misuse_score(events, open to-do items): -(misuses), 0 is clean
    parallel_tool_calls  parallel_tool_calls_score(each message's events): share of the read-only
                    calls that ran alongside another, in [0, 1)
    tool_efficiency tool_efficiency_score(events): -(redundant calls), 0 is clean

Style counts only what the model added: pyflakes warnings (it parses, never
imports or runs the code) and reasoning left in comments, each only on lines
that are new against the original text (`difflib`; a new file is all new), so
a model is neither blamed for the code base's old warnings nor rewarded for
deleting them. Reading the workspace never follows a symlink, never opens a
FIFO or device, and skips caches, binaries and files over `MAX_TEXT_BYTES`:
the model wrote that workspace.
"""
from __future__ import annotations

import difflib
import io
import os
import posixpath
import re
import stat
import tokenize
from pathlib import Path
from typing import Mapping, Optional, Sequence

from pyflakes import checker as pyflakes_checker

from .tasks.coding.task import CACHE_DIRS, CACHE_SUFFIXES
from .tasks.python_ast import PARSE_LOCK, parse_python
from .tools import READ_ONLY_TOOLS, WORKSPACE_MOUNT, ToolEvent, misuse_counts

MAX_TEXT_BYTES = 1 << 20  # larger files are not read (nor scored)
MAX_STYLE_PENALTY = 10  # style_score is at least -MAX_STYLE_PENALTY

# Comments that read like the model thinking aloud, not documenting: each matches the start of
# the comment's text (after "#"), case-insensitively. The ones that also start documentation
# ("Wait for ...", "Actually computes ...") need the punctuation of speech after them.
THINKING_COMMENT_PATTERNS = (
    r"i think\b",
    r"i'll\b", r"i’ll\b",
    r"let me\b",
    r"hm+\b",
    r"wait(\s*[,.!?…]|\s+[—-]\s)",
    r"actually\s*,",
    r"maybe i\b",
    r"now i\b",
    r"i need to\b",
    r"i should\b",
    r"i'm not sure\b",
    r"we need to figure\b",
    r"ok(ay)?,?\s+so\b",
    r"oops\b",
)
_THINKING = re.compile(r"#+\s*(?:" + "|".join(THINKING_COMMENT_PATTERNS) + ")", re.IGNORECASE)

Changes = Mapping[str, tuple[Optional[str], str]]


def _read_text(path: str, max_bytes: int) -> Optional[str]:
    """The UTF-8 text of the regular file at `path`; None for a link, a non-regular, large,
    binary (NUL bytes) or undecodable file."""
    try:
        # O_NOFOLLOW: a link is refused, not followed; O_NONBLOCK: opening a FIFO does not wait
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            return None
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes or b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def changed_files(original: Mapping[str, str], workspace: Path, *,
                  max_bytes: int = MAX_TEXT_BYTES) -> dict[str, tuple[Optional[str], str]]:
    """The text files of `workspace` that the model added or changed.

    Args:
        original: relative path ("a/b.py", "/"-separated) -> text the workspace started with.
        workspace: the folder the model worked in.
    Returns:
        {relative path: (original text, or None for a new file; new text)}, sorted by path.
        Deleted files are not reported; links (to files or folders), cache folders and
        compiled files (`CACHE_DIRS`, `CACHE_SUFFIXES`), and binary, undecodable or
        larger-than-`max_bytes` files are skipped.
    """
    root = os.path.realpath(workspace)
    changes: dict[str, tuple[Optional[str], str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False: linked folders are not entered
        dirnames[:] = sorted(d for d in dirnames if d not in CACHE_DIRS)
        for name in sorted(filenames):
            if name.endswith(CACHE_SUFFIXES):
                continue
            full = os.path.join(dirpath, name)
            text = _read_text(full, max_bytes)
            if text is None:
                continue
            relative = os.path.relpath(full, root).replace(os.sep, "/")
            old = original.get(relative)
            if old != text:
                changes[relative] = (old, text)
    return dict(sorted(changes.items()))


def new_lines(old: Optional[str], new: str) -> set[int]:
    """1-based numbers of the lines of `new` that are not in `old` (all of them when old is None)."""
    new_split = new.splitlines()
    if old is None:
        return set(range(1, len(new_split) + 1))
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new_split, autojunk=False)
    added: set[int] = set()
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            added.update(range(j1 + 1, j2 + 1))
    return added


def _pyflakes_issues(path: str, text: str, lines: set[int]) -> list[tuple[int, str]]:
    """(line, warning) for pyflakes' warnings of `text` on `lines`; a file that does not parse
    is one issue."""
    try:
        with PARSE_LOCK:  # pyflakes parses string annotations with ast.parse (`python_ast`)
            # SyntaxWarnings (invalid escapes) are not ours to print
            tree = parse_python(text, path, quiet=True)
            messages = pyflakes_checker.Checker(tree, filename=path).messages
    except SyntaxError as exc:
        return [(exc.lineno or 1, f"syntax error: {exc.msg}")]
    except (ValueError, RecursionError) as exc:  # NUL in the source, nesting too deep for the parser
        return [(1, f"does not parse: {type(exc).__name__}")]
    return [(m.lineno, m.message % m.message_args) for m in messages if m.lineno in lines]


def thinking_comments(text: str, lines: set[int]) -> list[tuple[int, str]]:
    """(line, comment) for the Python comments on `lines` that read like reasoning
    (`THINKING_COMMENT_PATTERNS`). Tokenizes, so a "#" inside a string is no comment;
    a file that stops tokenizing keeps the comments found before that point."""
    found = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            line = token.start[0]
            if token.type == tokenize.COMMENT and line in lines and _THINKING.match(token.string):
                found.append((line, token.string))
    except (tokenize.TokenError, SyntaxError):
        pass
    return found


def style_issues(changes: Changes) -> list[str]:
    """The style issues the model added to the changed `.py` files, each "path:line: message":
    pyflakes warnings on new lines (a file that does not parse: one issue) and reasoning left
    in comments on new lines."""
    issues: list[str] = []
    for path, (old, new) in sorted(changes.items()):
        if not path.endswith(".py"):
            continue
        lines = new_lines(old, new)  # may be empty: a deletion can still break the parse
        found = _pyflakes_issues(path, new, lines) + [
            (line, f"reasoning left in a comment: {comment[:60]}") for line, comment in thinking_comments(new, lines)]
        issues += [f"{path}:{line}: {message}" for line, message in sorted(found)]
    return issues


def style_score(changes: Changes) -> float:
    """-len(style_issues(changes)), at least -MAX_STYLE_PENALTY; 0.0 is clean."""
    return -float(min(len(style_issues(changes)), MAX_STYLE_PENALTY))


def communication_score(final_message: Optional[str], *, min_chars: int = 1, max_chars: int = 600) -> float:
    """1.0 when the final message, stripped, has min_chars <= length <= max_chars; else 0.0
    (no message at all: a reply without `finish`, or a trajectory cut by a limit)."""
    if not 1 <= min_chars <= max_chars:
        raise ValueError(f"communication bounds min_chars={min_chars}, max_chars={max_chars} must satisfy "
                         "1 <= min_chars <= max_chars")
    if final_message is None:
        return 0.0
    return float(min_chars <= len(final_message.strip()) <= max_chars)


def tool_misuse_score(events: Sequence[ToolEvent], open_todo_items: int) -> float:
    """-(number of misuses) over a trajectory's events (`tools.MISUSE_KINDS`), each counted once.

    `ToolSet.respond` records one event per misuse, and an "unfinished_todo" event
    when `finish` leaves items open. A reply with no call also ends the task
    (a "no_tool_call" event) but `respond` checks no to-do list then: open items
    (`open_todo_items` > 0) count as the one "unfinished_todo" misuse in that case.
    A trajectory stopped by a limit chose no end, so its open items are not counted.
    """
    counts = misuse_counts(events)
    total = sum(counts.values())
    if open_todo_items > 0 and counts["no_tool_call"] and not counts["unfinished_todo"]:
        total += 1
    return -float(total)


def parallel_tool_calls_score(messages: Sequence[Sequence[ToolEvent]]) -> float:
    """Credit for batching independent calls: B / N, 0.0 when N = 0.

    `messages` holds the events of each model message of a trajectory, in order
    (`[turn.events for turn in trajectory.turns]`). In each message, a batch is
    a maximal run of consecutive read-only calls (`tools.READ_ONLY_TOOLS`) that
    ran (misuse None); these are exactly the calls `ToolSet.respond` runs at
    once. N is the number of such calls over the trajectory and
    B = sum over batches of (batch size - 1), the model turns the batching
    saved. So three reads in one message and one read alone give 2 / 4 = 0.5;
    reads made one per message give 0. Writes, runs and tests are never
    credited: a call that needs an earlier call's result cannot share its turn.
    """
    total = saved = 0
    for events in messages:
        run = 0
        for event in [*events, None]:  # None closes the last batch
            if event is not None and event.name in READ_ONLY_TOOLS and event.misuse is None:
                run += 1
                continue
            total, saved, run = total + run, saved + max(0, run - 1), 0
    return saved / total if total else 0.0


_ALL_PASS_REPORT = re.compile(r"(\d+) passed, 0 failed, 0 errors of \1 tests(?! \(timed out\))")
_CHANGING_TOOLS = ("write_file", "edit_file", "run")  # calls that may change the workspace
_NOT_RUN = ("unknown_tool", "bad_arguments")


def _place(arguments: Optional[dict]) -> str:
    """A workspace path as one key: "a.py", "./a.py" and "/workspace/a.py" are one file."""
    path = str((arguments or {}).get("path", ".")).strip()
    if path == WORKSPACE_MOUNT or path.startswith(WORKSPACE_MOUNT + "/"):
        path = path[len(WORKSPACE_MOUNT):].lstrip("/")
    return posixpath.normpath(path or ".")


def tool_efficiency_score(events: Sequence[ToolEvent]) -> float:
    """-(redundant calls) over a trajectory's events, in order; 0.0 is clean.

    A call (an event with a tool name; `finish` and `todo` excluded: ending
    the task and ticking off the list are never waste) is redundant when, since
    the last call that may have changed the workspace (a `write_file` or
    `edit_file` that succeeded, or any `run` that ran), at least one holds:

        reread      it is `read_file` of a file already read successfully
        relist      it is `list_dir` of a folder already listed successfully
        retest      it is `run_tests` and `run_tests` already ran
        solved      the last `run_tests` reported every test passing
                    ("N passed, 0 failed, 0 errors of N tests", N >= 1)

    Each redundant call counts once, whatever the number of reasons. Paths
    are compared after normalization ("./a.py", "a.py" and "/workspace/a.py"
    are one file). Calls that were not run (unknown tool, bad arguments) are
    misuse, counted by `tool_misuse_score`, not here.
    """
    read: set[str] = set()
    listed: set[str] = set()
    tested = solved = False
    redundant = 0
    for event in events:
        if event.name is None or event.name in ("finish", "todo") or event.misuse in _NOT_RUN:
            continue
        place = _place(event.arguments)
        redundant += int(solved or (event.name == "read_file" and place in read)
                         or (event.name == "list_dir" and place in listed)
                         or (event.name == "run_tests" and tested))
        if event.name in _CHANGING_TOOLS and (event.ok or event.name == "run"):
            read, listed, tested, solved = set(), set(), False, False
        elif event.name == "read_file" and event.ok:
            read.add(place)
        elif event.name == "list_dir" and event.ok:
            listed.add(place)
        elif event.name == "run_tests":
            match = _ALL_PASS_REPORT.match(event.output) if event.ok else None
            tested, solved = True, bool(match) and int(match.group(1)) >= 1
    return -float(redundant)
