"""The tools of the agentic coding environment, and how their calls are checked and run.

The model calls tools in the one format of `data.tool_calls` (the server
uses it too)::

    <tool_call>{"name": "edit_file", "arguments": {"path": "calc.py", "search": "a - b", "replace": "a + b"}}</tool_call>

and reads each result back in a user turn as
``<tool_response name="edit_file">...</tool_response>``. The tools:

    read_file(path)                    the file's text
    write_file(path, content)          create or overwrite a file (parent folders too)
    edit_file(path, search, replace)   replace the one exact occurrence of `search`
    list_dir(path=".")                 entries, folders with a trailing "/"
    grep(pattern, path=".")            Python-regex matches as path:line: text
    run(command)                       a shell command in the sandbox (`rl.sandbox`)
    run_tests()                        the task's tests, from their pristine copy
    todo(items)                        write the to-do list: [{"text": ..., "done": false}, ...]
    finish(message)                    end the task with a final message to the user

One reply may make several calls (`data.tool_calls`: several blocks, or a
JSON list in one block; at most `MAX_CALLS_PER_MESSAGE` in all). They run
in the order written, except that a run of consecutive read-only calls
(`READ_ONLY_TOOLS`: read_file, list_dir, grep) runs at once, in threads;
every other call (a write, `run`, `run_tests`, `todo`, `finish`) waits for
the calls before it and runs alone. So a read written after a write sees the
write, and reads that run together cannot see each other's effects (they
have none). The responses come back in call order in one user turn.
(`grep` runs in the sandbox, which runs one command at a time: the greps of a
batch take turns there while its file reads and listings go on.)

Calls are checked strictly: the JSON of the block (`data.tool_calls`), the
tool's name, and its arguments against the tool's parameters (required ones
present, no unknown ones, exact JSON types: `true` is not an integer). A
call that fails a check is not run; the model gets an error observation
naming the problem and the fix, and the `ToolEvent` records the misuse
(`MISUSE_KINDS`). Nothing the model writes raises out of `ToolSet.respond`.

Files are read and written by this process, not in the sandbox (a sandboxed
`cat` costs a process start): every path is resolved inside the workspace
(`resolve`): relative paths, or absolute ones under ``/workspace`` (what the
sandbox calls it); ``..`` and symlinks that lead out are refused. No command
of the model runs while a tool reads or writes (`Sandbox.run` returns only
when its whole process tree is dead), so a link cannot change between the
check and the use.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import os
import re
import shlex
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..data.tool_calls import MAX_CALLS_PER_MESSAGE, ToolCall, render_tool_response, tool_call_blocks

WORKSPACE_MOUNT = "/workspace"  # the workspace's path inside the sandbox

MISUSE_KINDS = (
    "malformed",  # the <tool_call> block is not the documented JSON
    "unknown_tool",  # a name that is not one of the offered tools
    "bad_arguments",  # missing, unknown or mistyped arguments
    "terminal_for_dedicated",  # `run` doing what a dedicated tool does (cat, ls, grep, sed -i, pytest, ...)
    "unfinished_todo",  # finish while to-do items are open
    "no_tool_call",  # a reply with no call at all (the task ends without finish)
)


@dataclasses.dataclass(frozen=True)
class Param:
    type: str  # a JSON type: "string", "integer", "boolean", "array", "object"
    description: str
    required: bool = True


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: dict[str, Param]


TOOLS: dict[str, ToolSpec] = {spec.name: spec for spec in (
    ToolSpec("read_file", "read a text file", {"path": Param("string", "file path")}),
    ToolSpec("write_file", "create or overwrite a file", {
        "path": Param("string", "file path"), "content": Param("string", "the whole new text")}),
    ToolSpec("edit_file", "replace the one exact occurrence of search with replace", {
        "path": Param("string", "file path"), "search": Param("string", "exact text, found once"),
        "replace": Param("string", "new text")}),
    ToolSpec("list_dir", "list a folder", {"path": Param("string", "folder, default .", required=False)}),
    ToolSpec("grep", "search files with a Python regex", {
        "pattern": Param("string", "regular expression"),
        "path": Param("string", "file or folder, default .", required=False)}),
    ToolSpec("run", "run a shell command in the sandbox", {"command": Param("string", "shell command")}),
    ToolSpec("run_tests", "run the task's tests", {}),
    ToolSpec("todo", "write the to-do list", {
        "items": Param("array", 'list of {"text": str, "done": bool}')}),
    ToolSpec("finish", "end the task", {"message": Param("string", "final message to the user")}),
)}

# tools that change nothing (files, to-do list, sandbox): consecutive calls of them run at once
READ_ONLY_TOOLS = ("read_file", "list_dir", "grep")

# what `run` should not be used for when the dedicated tool is offered: first word -> tool
_TERMINAL_FOR = {"cat": "read_file", "head": "read_file", "tail": "read_file", "less": "read_file",
                 "more": "read_file", "ls": "list_dir", "grep": "grep", "egrep": "grep", "rg": "grep",
                 "pytest": "run_tests", "tee": "write_file"}
_JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "array": list, "object": dict}


def grep_matches(root: str, target: str, pattern: str, max_bytes: int) -> list:
    """"path:line: text" for every line matching `pattern` in the regular files at `target`
    (relative to `root`; a folder is walked without following links). Self-contained: `ToolSet.grep`
    runs its source in the sandbox."""
    import os
    import re
    import stat

    regex, start = re.compile(pattern), os.path.join(root, target)
    files = [start] if not os.path.isdir(start) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(start) for f in names)
    hits = []
    for file in files:
        try:
            info = os.lstat(file)
            if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
                continue  # links are not followed; a FIFO would block the read
            with open(file, "rb") as f:
                lines = f.read().decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        shown = os.path.relpath(file, root)
        hits += [f"{shown}:{i}: {line}" for i, line in enumerate(lines, 1) if regex.search(line)]
    return hits


_GREP_MAIN = """
import sys
print("\\n".join(grep_matches("/workspace", sys.argv[1], sys.argv[2], int(sys.argv[3]))))
"""


def tool_schemas(names: Sequence[str]) -> list[dict]:
    """The tools as OpenAI function schemas (for `data.tool_calls.render_tools` or a server)."""
    schemas = []
    for name in names:
        spec = TOOLS[name]
        schemas.append({"type": "function", "function": {
            "name": name, "description": spec.description,
            "parameters": {"type": "object",
                           "properties": {k: {"type": p.type, "description": p.description}
                                          for k, p in spec.params.items()},
                           "required": [k for k, p in spec.params.items() if p.required]}}})
    return schemas


def render_tool_prompt(names: Sequence[str]) -> str:
    """The system-prompt block listing `names`, one line each: compact, so that a small
    context keeps room for the work (the full JSON schemas are `tool_schemas`)."""
    lines = []
    for name in names:
        spec = TOOLS[name]
        args = ", ".join(f"{k}: {p.type}" + ("" if p.required else "?") for k, p in spec.params.items())
        lines.append(f"- {name}({args}): {spec.description}")
    return ("Tools (call one by writing "
            '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>; '
            f"several as a JSON list, at most {MAX_CALLS_PER_MESSAGE}):\n"
            + "\n".join(lines))


def check_arguments(spec: ToolSpec, arguments: dict) -> Optional[str]:
    """What is wrong with `arguments` for `spec` (with the fix), or None."""
    unknown = sorted(set(arguments) - set(spec.params))
    if unknown:
        return (f"{spec.name} takes no argument {unknown[0]!r}; its arguments are "
                f"{sorted(spec.params) or 'none'}")
    for key, param in spec.params.items():
        if key not in arguments:
            if param.required:
                return f"{spec.name} needs the argument {key!r} ({param.type}: {param.description})"
            continue
        value, want = arguments[key], _JSON_TYPES[param.type]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            return f"{spec.name} argument {key!r} must be a JSON {param.type}, got {type(value).__name__}"
    return None


@dataclasses.dataclass
class ToolEvent:
    """One call (or malformed block) and what became of it."""

    name: Optional[str]
    arguments: Optional[dict]
    ok: bool  # ran without error
    misuse: Optional[str] = None  # one of MISUSE_KINDS
    error: Optional[str] = None
    output: str = ""  # the response text the model got (run_tests: the report `agentic_rewards` reads)


@dataclasses.dataclass
class ToolTurn:
    """The environment's answer to one model turn."""

    observation: str  # the text of the user turn that carries the responses
    events: list[ToolEvent]
    finished: bool = False
    final_message: Optional[str] = None


class ToolError(Exception):
    """A tool that cannot do what was asked; its message goes back to the model."""


class ToolSet:
    """The tools bound to one workspace and its sandbox.

    Args:
        workspace: the host folder the sandbox mounts at /workspace.
        sandbox: an `rl.sandbox.Sandbox` on it (for `run`); None disables `run`.
        run_tests: callable -> str, the task's test report (for `run_tests`).
        names: the tools offered (default: all); a call to another is "unknown_tool".
        max_output_chars: longer results are cut, with a note saying so.
        max_file_bytes: read_file refuses, and write_file / edit_file will not write, larger files.
        parallel_reads: run consecutive read-only calls of one reply at once (False: one by one;
            the responses are the same either way).
    """

    def __init__(self, workspace, sandbox=None, *, run_tests: Optional[Callable[[], str]] = None,
                 names: Sequence[str] = tuple(TOOLS), max_output_chars: int = 2000,
                 max_file_bytes: int = 1 << 20, parallel_reads: bool = True):
        unknown = [n for n in names if n not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tool {unknown[0]!r}; the tools are {', '.join(TOOLS)}")
        self.root = Path(os.path.realpath(workspace))
        if not self.root.is_dir():
            raise ValueError(f"workspace {workspace} is not a folder")
        self.sandbox, self._run_tests = sandbox, run_tests
        self.names = tuple(names)
        self.max_output_chars, self.max_file_bytes = max_output_chars, max_file_bytes
        self.parallel_reads = parallel_reads
        self.todo_items: list[dict] = []

    # ---- paths ------------------------------------------------------------
    def resolve(self, path: str) -> Path:
        """The host path of a workspace path; ToolError when it leaves the workspace."""
        if "\x00" in path:
            raise ToolError("the path contains a NUL byte")
        rel = path.strip()
        if rel == WORKSPACE_MOUNT or rel.startswith(WORKSPACE_MOUNT + "/"):
            rel = rel[len(WORKSPACE_MOUNT):].lstrip("/")
        elif rel.startswith("/"):
            raise ToolError(f"path {path!r} is outside the workspace; give a path relative to it "
                            f"(or under {WORKSPACE_MOUNT})")
        real = os.path.realpath(self.root / (rel or "."))
        if real != str(self.root) and not real.startswith(str(self.root) + os.sep):
            raise ToolError(f"path {path!r} leads outside the workspace; stay inside it")
        return Path(real)

    def _shown(self, host_path: Path) -> str:
        return os.path.relpath(host_path, self.root)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[:self.max_output_chars] + f"\n[... cut: {len(text) - self.max_output_chars} more characters]"

    # ---- the tools --------------------------------------------------------
    def read_file(self, path: str) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise ToolError(f"no file {path!r}" + (" (it is a folder; use list_dir)" if target.is_dir() else ""))
        if target.stat().st_size > self.max_file_bytes:
            raise ToolError(f"{path!r} has {target.stat().st_size} bytes, more than {self.max_file_bytes}; "
                            "use grep to find what you need")
        return self._cut(target.read_bytes().decode("utf-8", errors="replace"))

    def _write(self, target: Path, content: str) -> int:
        data = content.encode("utf-8")
        if len(data) > self.max_file_bytes:
            raise ToolError(f"the content has {len(data)} bytes, more than {self.max_file_bytes}")
        if target.is_dir():
            raise ToolError(f"{self._shown(target)!r} is a folder")
        if target.exists() and not target.is_file():  # a FIFO would block the write until read
            raise ToolError(f"{self._shown(target)!r} is not a regular file; write to another path")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return len(data)

    def write_file(self, path: str, content: str) -> str:
        target = self.resolve(path)
        size = self._write(target, content)
        return f"wrote {size} bytes to {self._shown(target)}"

    def edit_file(self, path: str, search: str, replace: str) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise ToolError(f"no file {path!r}; create it with write_file")
        if target.stat().st_size > self.max_file_bytes:
            raise ToolError(f"{path!r} has {target.stat().st_size} bytes, more than {self.max_file_bytes}")
        text = target.read_bytes().decode("utf-8", errors="replace")
        count = text.count(search) if search else 0
        if count != 1:
            where = "is empty" if not search else f"occurs {count} times in {path!r}"
            raise ToolError(f"search {where}; give exact text that occurs once (read_file shows the file)")
        self._write(target, text.replace(search, replace, 1))
        return f"edited {self._shown(target)}"

    def list_dir(self, path: str = ".") -> str:
        target = self.resolve(path)
        if not target.is_dir():
            raise ToolError(f"no folder {path!r}")
        names = sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in os.scandir(target))
        return self._cut("\n".join(names) if names else "(empty)")

    def grep(self, pattern: str, path: str = ".") -> str:
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as exc:  # a huge repeat count, deep nesting
            raise ToolError(f"pattern {pattern!r} is not a Python regular expression ({exc})") from None
        target = os.path.relpath(self.resolve(path), self.root)
        if self.sandbox is None:
            hits = grep_matches(str(self.root), target, pattern, self.max_file_bytes)
        else:
            # in the sandbox, under its wall clock: Python's re holds the GIL for a whole match,
            # so a pattern that backtracks without end, e.g. (a+)+$, would stall every episode here
            if "\x00" in pattern:
                raise ToolError("the pattern contains a NUL byte")
            script = inspect.getsource(grep_matches) + _GREP_MAIN
            result = self.sandbox.run(["python3", "-c", script, target, pattern, str(self.max_file_bytes)])
            if result.timed_out:
                raise ToolError(f"grep {pattern!r} ran past the time limit; use a simpler pattern")
            if result.exit_code != 0:
                raise ToolError(f"grep failed: {result.stderr.strip()[-300:]}")
            hits = [h for h in result.stdout.splitlines() if h] + (["[... cut]"] if result.truncated else [])
        return self._cut("\n".join(hits) if hits else "no matches")

    def run(self, command: str) -> str:
        if self.sandbox is None:
            raise ToolError("run is not available in this environment")
        result = self.sandbox.run(command)
        parts = [f"exit code {result.exit_code}" + (" (timed out)" if result.timed_out else "")]
        if result.stdout:
            parts.append(result.stdout.rstrip("\n"))
        if result.stderr:
            parts.append("stderr:\n" + result.stderr.rstrip("\n"))
        return self._cut("\n".join(parts))

    def run_tests(self) -> str:
        if self._run_tests is None:
            raise ToolError("this task has no tests to run")
        return self._cut(self._run_tests())

    def todo(self, items: list) -> str:
        checked = []
        for i, item in enumerate(items):
            if not (isinstance(item, dict) and isinstance(item.get("text"), str)
                    and isinstance(item.get("done", False), bool) and set(item) <= {"text", "done"}):
                raise ToolError(f'todo item {i} is {item!r}; write {{"text": "...", "done": false}}')
            checked.append({"text": item["text"], "done": item.get("done", False)})
        self.todo_items = checked
        return "\n".join(f"[{'x' if t['done'] else ' '}] {t['text']}" for t in checked) or "(empty to-do list)"

    def open_todo_items(self) -> int:
        return sum(not t["done"] for t in self.todo_items)

    # ---- dispatch ---------------------------------------------------------
    def _terminal_misuse(self, command: str) -> Optional[str]:
        """The dedicated tool that `command` stands in for, if it is offered."""
        try:
            words = shlex.split(command.split("|")[0].split("&&")[0].split(";")[0])
        except ValueError:
            return None
        if not words:
            return None
        first, tool = os.path.basename(words[0]), None
        if first in _TERMINAL_FOR:
            tool = _TERMINAL_FOR[first]
        elif first == "sed" and any(w.startswith("-i") for w in words[1:]):
            tool = "edit_file"
        elif first in ("python", "python3") and words[1:3] == ["-m", "pytest"]:
            tool = "run_tests"
        elif first in ("echo", "printf") and any(w in (">", ">>") or w.startswith(">") for w in words):
            tool = "write_file"
        return tool if tool in self.names else None

    def execute(self, call: ToolCall) -> tuple[str, ToolEvent]:
        """Run one parsed call: (its response text, its event, whose `output` is that text).
        Never raises on model input."""
        text, event = self._execute(call)
        event.output = text
        return text, event

    def _execute(self, call: ToolCall) -> tuple[str, ToolEvent]:
        if call.name not in self.names:
            error = f"unknown tool {call.name!r}; the tools are {', '.join(self.names)}"
            return error, ToolEvent(call.name, call.arguments, False, "unknown_tool", error)
        problem = check_arguments(TOOLS[call.name], call.arguments)
        if problem is not None:
            return problem, ToolEvent(call.name, call.arguments, False, "bad_arguments", problem)
        misuse = None
        if call.name == "run":
            dedicated = self._terminal_misuse(call.arguments["command"])
            misuse = "terminal_for_dedicated" if dedicated else None
        try:
            if call.name == "finish":
                return "done", ToolEvent("finish", call.arguments, True)
            text = getattr(self, call.name)(**call.arguments)
        except ToolError as exc:
            return f"error: {exc}", ToolEvent(call.name, call.arguments, False, misuse, str(exc))
        except (OSError, UnicodeError, ValueError) as exc:  # a file the model made unreadable, a name too long ...
            return f"error: {exc}", ToolEvent(call.name, call.arguments, False, misuse, str(exc))
        if misuse:
            text += f"\n(note: use the {dedicated} tool for this)"
        return text, ToolEvent(call.name, call.arguments, True, misuse)

    def respond(self, text: str) -> ToolTurn:
        """Everything one model reply asks for: its calls run (module docstring), up to `finish`.

        Malformed blocks get an error response (misuse "malformed"); a reply
        with no block at all is "no_tool_call" and ends the task (its text is
        taken as the final message). Calls after `finish` are not run, nor
        those past the first MAX_CALLS_PER_MESSAGE (one "malformed" event says so).
        """
        blocks = tool_call_blocks(text)
        if not blocks:
            event = ToolEvent(None, None, False, "no_tool_call", "the reply has no tool call")
            return ToolTurn("", [event], finished=True, final_message=None)
        # the reply's items in order: a call, or the error of a malformed block
        items: list[ToolCall | str] = []
        for number, block in enumerate(blocks, 1):
            if block.problem is not None:
                items.append(f"tool call {number}: {block.problem}")
            else:
                items += block.calls
        calls = [i for i, item in enumerate(items) if isinstance(item, ToolCall)]
        dropped = len(calls) - MAX_CALLS_PER_MESSAGE
        if dropped > 0:
            items = items[:calls[MAX_CALLS_PER_MESSAGE]]
            items.append(f"the reply makes {len(calls)} calls, more than {MAX_CALLS_PER_MESSAGE}; "
                         f"the last {dropped} were not run: make them in the next reply")
        responses: list[str] = []
        events: list[ToolEvent] = []
        for group in self._groups(items):
            if isinstance(group[0], str):
                error = group[0]
                events.append(ToolEvent(None, None, False, "malformed", error, output=error))
                responses.append(render_tool_response("invalid", error + '; write <tool_call>{"name": '
                                                      '"NAME", "arguments": {...}}</tool_call>'))
                continue
            for call, (response, event) in zip(group, self._run_group(group)):
                events.append(event)
                if event.name == "finish" and event.ok:
                    open_items = [t["text"] for t in self.todo_items if not t["done"]]
                    if open_items:
                        listed = "; ".join(repr(t[:80]) for t in open_items[:5])
                        events.append(ToolEvent("finish", None, False, "unfinished_todo",
                                                f"{len(open_items)} to-do items are open at finish: {listed}"))
                    return ToolTurn("\n".join(responses), events, True, call.arguments["message"])
                responses.append(render_tool_response(call.name, response))
        return ToolTurn("\n".join(responses), events)

    @staticmethod
    def _groups(items: list) -> list[list]:
        """`items` cut into what runs together: each run of consecutive read-only calls is one
        group; every other call and every error is a group of its own."""
        groups: list[list] = []
        for item in items:
            reads = isinstance(item, ToolCall) and item.name in READ_ONLY_TOOLS
            if reads and groups and isinstance(groups[-1][0], ToolCall) and groups[-1][0].name in READ_ONLY_TOOLS:
                groups[-1].append(item)
            else:
                groups.append([item])
        return groups

    def _run_group(self, group: list[ToolCall]) -> list[tuple[str, ToolEvent]]:
        """(response, event) of each call of `group`, in its order: read-only groups at once."""
        if len(group) == 1 or not self.parallel_reads:
            return [self.execute(call) for call in group]
        with concurrent.futures.ThreadPoolExecutor(len(group), thread_name_prefix="tool-read") as pool:
            return list(pool.map(self.execute, group))


def misuse_counts(events: Sequence[ToolEvent]) -> dict[str, int]:
    """{misuse kind: count} over `events` (every kind present, 0 when unseen)."""
    counts = dict.fromkeys(MISUSE_KINDS, 0)
    for event in events:
        if event.misuse:
            counts[event.misuse] += 1
    return counts

