"""The agent's tools with hostile input: fuzzed replies, paths that try to leave the workspace,
links to a host canary, FIFOs, size limits, terminal misuse, the to-do list."""
import contextlib
import json
import os
import signal
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_composer.data.tool_calls import (MAX_CALLS_PER_MESSAGE, ToolCall, format_tool_call, format_tool_calls,
                                               render_tool_response, tool_call_blocks)
from megatron_composer.rl.tools import MISUSE_KINDS, TOOLS, ToolSet, ToolTurn, misuse_counts

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# The tools' parameters written out again by hand, as the reference for "bad_arguments":
# name -> {argument: (Python type of its JSON type, required)}.
PARAMETERS = {
    "read_file": {"path": (str, True)},
    "write_file": {"path": (str, True), "content": (str, True)},
    "edit_file": {"path": (str, True), "search": (str, True), "replace": (str, True)},
    "list_dir": {"path": (str, False)},
    "grep": {"pattern": (str, True), "path": (str, False)},
    "run": {"command": (str, True)},
    "run_tests": {},
    "todo": {"items": (list, True)},
    "finish": {"message": (str, True)},
}


def arguments_are_valid(name: str, arguments: dict) -> bool:
    params = PARAMETERS[name]
    if set(arguments) - set(params) or any(req and key not in arguments for key, (_, req) in params.items()):
        return False
    return all(type(value) is params[key][0] for key, value in arguments.items())  # bool is no int


class FakeSandbox:
    """`Sandbox.run`'s interface: records the commands, answers with a fixed result."""

    def __init__(self, stdout="out\n", stderr="", exit_code=0, timed_out=False):
        self.commands = []
        self.result = SimpleNamespace(exit_code=exit_code, stdout=stdout, stderr=stderr, timed_out=timed_out)

    def run(self, command):
        self.commands.append(command)
        return self.result


@contextlib.contextmanager
def workspace():
    """A fresh workspace per hypothesis example, with a file and a folder in it."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a.txt").write_text("alpha\nbeta\n")
        (Path(tmp) / "sub").mkdir()
        (Path(tmp) / "sub" / "b.py").write_text("x = 1\n")
        yield Path(tmp)


def check_turn(text: str, turn: ToolTurn, tools: ToolSet) -> None:
    """The events of `turn` are, block by block, what the reference above says they must be."""
    assert isinstance(turn, ToolTurn)
    blocks = tool_call_blocks(text)
    if not blocks:
        assert [e.misuse for e in turn.events] == ["no_tool_call"] and turn.finished
        return
    events = iter(turn.events)
    items = [call for block in blocks for call in (block.calls if block.problem is None else [None])]
    for call in items[:MAX_CALLS_PER_MESSAGE]:  # a reply with more calls is cut (test_call_lists)
        event = next(events)
        if call is None:
            assert event.misuse == "malformed" and not event.ok
            continue
        name, arguments = call.name, call.arguments
        if name not in tools.names:
            assert event.misuse == "unknown_tool" and not event.ok
        elif not arguments_are_valid(name, arguments):
            assert event.misuse == "bad_arguments" and not event.ok and event.error
        else:
            assert event.misuse in (None, "terminal_for_dedicated")
            assert event.ok or event.error
            if name == "finish":
                assert turn.finished and turn.final_message == arguments["message"]
                assert [e.misuse for e in events] == (["unfinished_todo"] if tools.open_todo_items() else [])
                return
    if sum(c is not None for c in items) > MAX_CALLS_PER_MESSAGE:
        return
    assert next(events, None) is None and not turn.finished


def respond_checked(text: str) -> ToolTurn:
    with workspace() as root:
        tools = ToolSet(root)
        turn = tools.respond(text)
        check_turn(text, turn, tools)
        return turn


# ---- fuzzing ------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
NAMES = st.sampled_from(sorted(TOOLS)) | st.text(max_size=12)
ARGUMENT_KEYS = st.sampled_from(sorted({k for p in PARAMETERS.values() for k in p})) | st.text(max_size=8)
PAYLOADS = st.fixed_dictionaries({"name": NAMES, "arguments": st.dictionaries(ARGUMENT_KEYS, JSON_VALUES, max_size=4)})
FRAGMENTS = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_call", "{", "}", '"name"', '"arguments"',
                             ":", ",", "[", "]", '"', "\\", " ", "\n", "null", '{"name": "list_dir", '
                             '"arguments": {}}', '{"name": "finish", "arguments": {"message": "m"}}'])


@FUZZ
@given(st.text())
def test_arbitrary_text_never_raises(text):
    respond_checked(text)


@FUZZ
@given(st.lists(FRAGMENTS | st.text(max_size=6), max_size=24).map("".join))
def test_text_around_and_inside_call_tags_never_raises(text):
    respond_checked(text)


@FUZZ
@given(st.lists(PAYLOADS | JSON_VALUES, min_size=1, max_size=4), st.text(max_size=10))
def test_json_payloads_are_checked_exactly(payloads, prose):
    text = prose + "".join(f"<tool_call>{json.dumps(p)}</tool_call>" for p in payloads)
    turn = respond_checked(text)
    if not isinstance(payloads[0], dict) or set(payloads[0]) != {"name", "arguments"}:
        assert turn.events[0].misuse == "malformed"


@FUZZ
@given(st.sampled_from(["read_file", "list_dir"]),
       st.text() | st.sampled_from(["a.txt", "sub", "sub/b.py", ".", "/workspace", "/workspace/sub", "..",
                                    "/", "/etc", "sub/../..", "a.txt/x", "/workspace/../etc"]))
def test_valid_read_and_list_calls_are_ok_or_an_error_observation(name, path):
    with workspace() as root:
        tools = ToolSet(root)
        turn = tools.respond(format_tool_call(name, {"path": path}))
        (event,) = turn.events
        assert event.misuse is None
        if event.ok:
            assert "error:" not in turn.observation
            if path.strip() in ("..", "/", "/etc", "sub/../..", "/workspace/../etc"):
                pytest.fail(f"{name}({path!r}) left the workspace")
        else:
            assert event.error and f"error: {event.error}" in turn.observation


# ---- paths --------------------------------------------------------------------
CANARY = "HOST CANARY\n"


@pytest.fixture
def planted(tmp_path):
    """A workspace with links out of it to a host folder holding a canary file."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "canary.txt").write_text(CANARY)
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n")
    (root / "link_file").symlink_to(host / "canary.txt")
    (root / "link_dir").symlink_to(host, target_is_directory=True)
    (root / "dangling").symlink_to(host / "new.txt")  # a link to a host file that does not exist yet
    (root / "sub" / "inner_link").symlink_to(root / "a.txt")
    yield SimpleNamespace(root=root, host=host, tools=ToolSet(root, FakeSandbox()))
    assert (host / "canary.txt").read_text() == CANARY
    assert sorted(p.name for p in host.iterdir()) == ["canary.txt"]


def outcome(tools, name, **arguments):
    (event,) = tools.respond(format_tool_call(name, arguments)).events
    assert event.misuse is None, event
    return event


@pytest.mark.parametrize("name, arguments", [
    ("read_file", {"path": "link_file"}),
    ("read_file", {"path": "link_dir/canary.txt"}),
    ("read_file", {"path": "../host/canary.txt"}),
    ("read_file", {"path": "sub/../../host/canary.txt"}),
    ("read_file", {"path": "/workspace/../host/canary.txt"}),
    ("write_file", {"path": "link_file", "content": "pwned"}),
    ("write_file", {"path": "link_dir/new.txt", "content": "pwned"}),
    ("write_file", {"path": "dangling", "content": "pwned"}),
    ("write_file", {"path": "../host/new.txt", "content": "pwned"}),
    ("edit_file", {"path": "link_file", "search": "HOST", "replace": "pwned"}),
    ("edit_file", {"path": "link_dir/canary.txt", "search": "HOST", "replace": "pwned"}),
    ("list_dir", {"path": "link_dir"}),
    ("list_dir", {"path": ".."}),
    ("grep", {"pattern": "CANARY", "path": "link_file"}),
    ("grep", {"pattern": "CANARY", "path": "link_dir"}),
    ("grep", {"pattern": "CANARY", "path": ".."}),
])
def test_links_and_dotdot_out_of_the_workspace_are_refused(planted, name, arguments):
    event = outcome(planted.tools, name, **arguments)
    assert not event.ok and "leads outside the workspace" in event.error


@pytest.mark.parametrize("path", ["/etc/passwd", "/tmp", "/workspacefoo/a.txt"])
def test_absolute_paths_outside_are_refused(planted, path):
    event = outcome(planted.tools, "read_file", path=path)
    assert not event.ok and "is outside the workspace" in event.error
    host_path = str(planted.host / "canary.txt")
    assert "outside the workspace" in outcome(planted.tools, "read_file", path=host_path).error
    assert "outside the workspace" in outcome(planted.tools, "write_file", path=host_path, content="x").error


def test_paths_inside_are_accepted(planted):
    tools = planted.tools
    assert tools.read_file("/workspace/a.txt") == tools.read_file("a.txt") == tools.read_file("sub/../a.txt")
    assert tools.read_file("sub/inner_link") == "alpha\n"  # a link that stays inside is fine
    assert tools.list_dir("/workspace") == tools.list_dir() == "a.txt\ndangling\nlink_dir\nlink_file\nsub/"
    assert tools.write_file("/workspace/sub/c.txt", "c") == "wrote 1 bytes to sub/c.txt"


def _greps(root):
    """grep in this process (no sandbox) and in a real sandbox: the same answers."""
    from megatron_composer.rl.sandbox import Sandbox

    return ToolSet(root), ToolSet(root, Sandbox(root, timeout_s=5))


def test_grep_over_the_workspace_does_not_follow_links(planted):
    for tools in _greps(planted.root):
        assert tools.grep("CANARY") == "no matches"
        assert tools.grep("alpha") == "a.txt:1: alpha"  # sub/inner_link is a link: skipped


def test_nul_bytes_in_a_path_are_refused(planted):
    for name, arguments in [("read_file", {"path": "a.txt\x00"}), ("write_file", {"path": "\x00", "content": ""}),
                            ("list_dir", {"path": "sub\x00/.."})]:
        event = outcome(planted.tools, name, **arguments)
        assert not event.ok and "NUL byte" in event.error
    # through the JSON escape the model would write
    (event,) = planted.tools.respond('<tool_call>{"name": "read_file", "arguments": {"path": "a\\u0000"}}'
                                     "</tool_call>").events
    assert "NUL byte" in event.error


def test_lone_surrogates_are_an_error_observation(planted):
    for arguments in ('{"path": "\\ud800"}', '{"path": "x.txt", "content": "\\udfff"}'):
        name = "write_file" if "content" in arguments else "read_file"
        (event,) = planted.tools.respond(f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}'
                                         "</tool_call>").events
        assert not event.ok and event.misuse is None
    assert not (planted.root / "x.txt").exists()


@contextlib.contextmanager
def deadline(seconds):
    """Fail instead of hanging: a blocked open() of a FIFO is interrupted by the alarm."""
    def expired(signum, frame):
        raise TimeoutError(f"the tool blocked for {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_in_the_workspace_blocks_no_tool(planted):
    os.mkfifo(planted.root / "pipe")
    tools = planted.tools
    with deadline(5):
        assert "no file" in outcome(tools, "read_file", path="pipe").error
        assert "no file" in outcome(tools, "edit_file", path="pipe", search="a", replace="b").error
        assert "not a regular file" in outcome(tools, "write_file", path="pipe", content="x").error
    for tools in _greps(planted.root):
        with deadline(8):
            assert tools.grep("alpha") == "a.txt:1: alpha"
            assert tools.grep("x", "pipe") == "no matches"


@pytest.mark.parametrize("pattern", ["(" * 1000 + ")" * 1000, "a{4294967296}", "[", "(?P<1>x)"])
def test_a_pattern_python_cannot_compile_is_an_error_observation(planted, pattern):
    event = outcome(planted.tools, "grep", pattern=pattern)
    assert not event.ok and "is not a Python regular expression" in event.error


# ---- edits, writes and limits -------------------------------------------------
def test_edit_file_needs_exactly_one_occurrence(tmp_path):
    tools = ToolSet(tmp_path)
    (tmp_path / "f.py").write_text("a = 1\na = 1\nb = 2\n")
    for search, message in [("c = 3", "occurs 0 times"), ("a = 1", "occurs 2 times"), ("", "search is empty")]:
        event = outcome(tools, "edit_file", path="f.py", search=search, replace="z")
        assert not event.ok and message in event.error
        assert (tmp_path / "f.py").read_text() == "a = 1\na = 1\nb = 2\n"
    assert outcome(tools, "edit_file", path="f.py", search="b = 2", replace="b = 3").ok
    assert (tmp_path / "f.py").read_text() == "a = 1\na = 1\nb = 3\n"
    assert "create it with write_file" in outcome(tools, "edit_file", path="g.py", search="a", replace="b").error


def test_write_file_creates_parent_folders_and_refuses_folders(tmp_path):
    tools = ToolSet(tmp_path)
    assert tools.write_file("deep/er/f.txt", "héllo") == "wrote 6 bytes to deep/er/f.txt"
    assert (tmp_path / "deep" / "er" / "f.txt").read_text() == "héllo"
    assert "is a folder" in outcome(tools, "write_file", path="deep", content="x").error
    assert "is a folder" in outcome(tools, "write_file", path="/workspace", content="x").error
    event = outcome(tools, "write_file", path="deep/er/f.txt/under_a_file", content="x")  # OSError, reported
    assert not event.ok and event.error


def test_size_limits(tmp_path):
    tools = ToolSet(tmp_path, max_file_bytes=10, max_output_chars=8)
    assert "more than 10" in outcome(tools, "write_file", path="big.txt", content="x" * 11).error
    assert not (tmp_path / "big.txt").exists()
    (tmp_path / "big.txt").write_text("y" * 11)
    assert "has 11 bytes, more than 10" in outcome(tools, "read_file", path="big.txt").error
    (tmp_path / "small.txt").write_text("abcdefghij")
    assert tools.read_file("small.txt") == "abcdefgh\n[... cut: 2 more characters]"
    assert "more than 10" in outcome(tools, "edit_file", path="small.txt", search="a", replace="AA").error
    assert (tmp_path / "small.txt").read_text() == "abcdefghij"
    assert ToolSet(tmp_path, max_file_bytes=10).grep("y") == "no matches"  # larger files are not searched


# ---- run: the terminal instead of a dedicated tool ----------------------------
@pytest.mark.parametrize("command, dedicated", [
    ("cat x", "read_file"), ("ls", "list_dir"), ("ls -la sub", "list_dir"), ("grep -r foo .", "grep"),
    ("sed -i 's/a/b/' f.py", "edit_file"), ("python3 -m pytest", "run_tests"), ("python -m pytest -q", "run_tests"),
    ("pytest tests", "run_tests"), ("echo hi > f", "write_file"), ("/bin/cat x | wc -l", "read_file"),
    ("head -n 3 a.txt && echo done", "read_file"),
])
def test_run_flags_the_terminal_for_a_dedicated_tool(command, dedicated):
    with workspace() as root:
        sandbox = FakeSandbox()
        tools = ToolSet(root, sandbox)
        turn = tools.respond(format_tool_call("run", {"command": command}))
        (event,) = turn.events
        assert event.ok and event.misuse == "terminal_for_dedicated"
        assert f"(note: use the {dedicated} tool for this)" in turn.observation
        assert sandbox.commands == [command]  # flagged, still run
        # not offered: the terminal is the only way, so no misuse
        others = [n for n in TOOLS if n != dedicated]
        (event,) = ToolSet(root, FakeSandbox(), names=others).respond(
            format_tool_call("run", {"command": command})).events
        assert event.ok and event.misuse is None


@pytest.mark.parametrize("command", ["python3 script.py", "python -c 'print(1)'", "sed 's/a/b/' f.py",
                                     "echo hi", "make test", "", "'unbalanced"])
def test_run_does_not_flag_other_commands(command):
    with workspace() as root:
        (event,) = ToolSet(root, FakeSandbox()).respond(format_tool_call("run", {"command": command})).events
        assert event.ok and event.misuse is None


def test_run_reports_the_result_and_needs_a_sandbox(tmp_path):
    tools = ToolSet(tmp_path, FakeSandbox(stdout="1 passed\n", stderr="warn\n", exit_code=1, timed_out=True))
    assert tools.run("python3 t.py") == "exit code 1 (timed out)\n1 passed\nstderr:\nwarn"
    event = outcome(ToolSet(tmp_path), "run", command="python3 t.py")
    assert not event.ok and "run is not available" in event.error


# ---- todo and misuse counts ---------------------------------------------------
@pytest.mark.parametrize("items", [[{"text": 1}], [{"text": "a", "done": "no"}], [{"text": "a", "done": 1}],
                                   [{"text": "a", "extra": True}], ["a string"], [{"done": True}], [[]]])
def test_bad_todo_items_are_an_error(tmp_path, items):
    tools = ToolSet(tmp_path)
    tools.todo([{"text": "kept", "done": False}])
    event = outcome(tools, "todo", items=items)
    assert not event.ok and 'write {"text": "...", "done": false}' in event.error
    assert tools.todo_items == [{"text": "kept", "done": False}]  # a bad list replaces nothing


def test_open_todo_items_at_finish_are_a_misuse(tmp_path):
    tools = ToolSet(tmp_path)
    assert tools.todo([{"text": "a"}, {"text": "b", "done": True}]) == "[ ] a\n[x] b"
    assert tools.todo([]) == "(empty to-do list)"
    tools.todo([{"text": "a"}, {"text": "b", "done": True}, {"text": "c", "done": False}])
    assert tools.open_todo_items() == 2
    turn = tools.respond(format_tool_call("finish", {"message": "bye"}) + format_tool_call("list_dir", {}))
    assert turn.finished and turn.final_message == "bye"
    assert [(e.name, e.ok, e.misuse) for e in turn.events] == [("finish", True, None),
                                                                ("finish", False, "unfinished_todo")]
    assert "2 to-do items are open" in turn.events[1].error
    tools.todo([{"text": "a", "done": True}])
    assert [e.misuse for e in tools.respond(format_tool_call("finish", {"message": "ok"})).events] == [None]


def test_misuse_counts_every_kind(tmp_path):
    tools = ToolSet(tmp_path, FakeSandbox())
    events = []
    for reply in ["no call here", "<tool_call>{]</tool_call>", format_tool_call("nope", {}),
                  format_tool_call("read_file", {"path": True}), format_tool_call("todo", {"items": {}}),
                  format_tool_call("run", {"command": "ls"}), format_tool_call("todo", {"items": [{"text": "t"}]}),
                  format_tool_call("finish", {"message": "m"})]:
        events += tools.respond(reply).events
    assert misuse_counts(events) == {"malformed": 1, "unknown_tool": 1, "bad_arguments": 2,
                                     "terminal_for_dedicated": 1, "unfinished_todo": 1, "no_tool_call": 1}
    assert list(misuse_counts([])) == list(MISUSE_KINDS) and set(misuse_counts([]).values()) == {0}


def test_grep_in_the_sandbox_matches_in_process_and_a_runaway_pattern_times_out(tmp_path):
    from megatron_composer.rl.sandbox import Sandbox

    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "a.py").write_text("x = 1\ny = 2\n")
    (ws / "sub" / "b.txt").write_text("x marks\nno\n")
    (ws / "slow.txt").write_text("a" * 40 + "b\n")
    sandboxed, local = ToolSet(ws, Sandbox(ws, timeout_s=2)), ToolSet(ws)
    assert sandboxed.grep("x") == local.grep("x") == "a.py:1: x = 1\nsub/b.txt:1: x marks"
    assert sandboxed.grep("x", "sub") == "sub/b.txt:1: x marks"
    text, event = sandboxed.execute(ToolCall("grep", {"pattern": "(a+)+$"}))
    assert not event.ok and "time limit" in text


# ---- several calls in one reply -------------------------------------------------
def _reads_workspace(root: Path) -> None:
    (root / "a.py").write_text("alpha = 1\n")
    (root / "b.py").write_text("beta = 2\nalpha = 3\n")
    (root / "sub").mkdir()


READS = [("read_file", {"path": "a.py"}), ("list_dir", {}), ("grep", {"pattern": "alpha"}),
         ("read_file", {"path": "missing.py"}), ("read_file", {"path": 3}), ("list_dir", {"path": "sub"}),
         ("grep", {"pattern": "("}), ("read_file", {"path": "b.py"})]


def test_concurrent_reads_answer_exactly_what_sequential_reads_answer(tmp_path):
    _reads_workspace(tmp_path)
    text = format_tool_calls(READS)
    parallel = ToolSet(tmp_path).respond(text)
    sequential = ToolSet(tmp_path, parallel_reads=False).respond(text)
    one_by_one = [ToolSet(tmp_path).respond(format_tool_call(n, a)) for n, a in READS]
    assert parallel.observation == sequential.observation == "\n".join(t.observation for t in one_by_one)
    assert parallel.events == sequential.events == [t.events[0] for t in one_by_one]
    assert [e.name for e in parallel.events] == [n for n, _ in READS]  # call order
    assert parallel.observation.startswith(render_tool_response("read_file", "alpha = 1\n"))


def test_consecutive_reads_really_run_at_once(tmp_path):
    import threading

    _reads_workspace(tmp_path)
    meeting = threading.Barrier(3, timeout=10)  # three reads that only finish together

    class Meeting(ToolSet):
        def read_file(self, path):
            meeting.wait()
            return super().read_file(path)

    turn = Meeting(tmp_path).respond(format_tool_calls([("read_file", {"path": p}) for p in ("a.py", "b.py", "a.py")]))
    assert [e.ok for e in turn.events] == [True] * 3


def test_writes_run_in_order_and_reads_after_a_write_see_it(tmp_path):
    _reads_workspace(tmp_path)
    calls = [("read_file", {"path": "a.py"}), ("edit_file", {"path": "a.py", "search": "1", "replace": "10"}),
             ("read_file", {"path": "a.py"}), ("list_dir", {}), ("write_file", {"path": "c.py", "content": "c"}),
             ("list_dir", {}), ("read_file", {"path": "c.py"})]
    turn = ToolSet(tmp_path).respond(format_tool_calls(calls))
    assert [e.output for e in turn.events] == ["alpha = 1\n", "edited a.py", "alpha = 10\n", "a.py\nb.py\nsub/",
                                               "wrote 1 bytes to c.py", "a.py\nb.py\nc.py\nsub/", "c"]
    assert all(e.ok for e in turn.events) and not turn.finished


def test_finish_in_a_list_stops_the_calls_after_it(tmp_path):
    _reads_workspace(tmp_path)
    turn = ToolSet(tmp_path).respond(format_tool_calls([("read_file", {"path": "a.py"}), ("finish", {"message": "m"}),
                                                        ("write_file", {"path": "z", "content": "z"})]))
    assert turn.finished and turn.final_message == "m" and [e.name for e in turn.events] == ["read_file", "finish"]
    assert not (tmp_path / "z").exists()


@pytest.mark.parametrize("text, kinds", [
    ('<tool_call>"read_file"</tool_call>', ["malformed"]),
    ('<tool_call>[[{"name": "list_dir", "arguments": {}}]]</tool_call>', ["malformed"]),
    ('<tool_call>[{"name": "list_dir", "arguments": {}}, 5]</tool_call>', ["malformed"]),
    ("<tool_call>[" + ", ".join(['{"name": "list_dir", "arguments": {}}'] * 9) + "]</tool_call>", ["malformed"]),
    ('<tool_call>[{"name": "nope", "arguments": {}}, {"name": "list_dir", "arguments": {"x": 1}}]</tool_call>',
     ["unknown_tool", "bad_arguments"]),
])
def test_malformed_call_lists_are_misuse_observations(tmp_path, text, kinds):
    turn = ToolSet(tmp_path).respond(text)
    assert [e.misuse for e in turn.events] == kinds and not turn.finished
    assert turn.observation.count("<tool_response") == len(kinds)


def test_more_calls_than_the_cap_in_separate_blocks_are_not_run(tmp_path):
    writes = [format_tool_call("write_file", {"path": f"f{i}", "content": ""}) for i in range(MAX_CALLS_PER_MESSAGE + 2)]
    turn = ToolSet(tmp_path).respond("".join(writes))
    assert [e.misuse for e in turn.events] == [None] * MAX_CALLS_PER_MESSAGE + ["malformed"]
    assert "the last 2 were not run" in turn.events[-1].error
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"f{i}" for i in range(MAX_CALLS_PER_MESSAGE))
