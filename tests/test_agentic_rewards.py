"""Behaviour reward values: changed files, style issues on new lines only, communication, tool misuse."""
import os
from types import SimpleNamespace

import pytest

from megatron_composer.rl.agentic_rewards import (
    MAX_TEXT_BYTES,
    changed_files,
    communication_score,
    new_lines,
    parallel_tool_calls_score,
    style_issues,
    style_score,
    thinking_comments,
    tool_efficiency_score,
    tool_misuse_score,
)
from megatron_composer.rl.rewards import REWARD_TERMS, parse_reward_weights, score
from megatron_composer.rl.tools import ToolEvent, ToolSet

ORIGINAL = "import os\n\n\ndef add(a, b):\n    return a - b\n"


# ---- changed_files ------------------------------------------------------------
def test_changed_files_reports_added_and_changed_text_only(tmp_path):
    original = {"calc.py": ORIGINAL, "same.txt": "x\n", "gone.txt": "y\n"}
    (tmp_path / "calc.py").write_text(ORIGINAL.replace("a - b", "a + b"))
    (tmp_path / "same.txt").write_text("x\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "new.py").write_text("VALUE = 1\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (tmp_path / "big.txt").write_text("z" * (MAX_TEXT_BYTES + 1))
    assert changed_files(original, tmp_path) == {
        "calc.py": (ORIGINAL, ORIGINAL.replace("a - b", "a + b")),
        "pkg/new.py": (None, "VALUE = 1\n"),
    }


def test_changed_files_skips_caches_and_compiled_files(tmp_path):
    for folder in ("__pycache__", ".pytest_cache", "pkg/__pycache__"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "junk.py").write_text("import os\n")
    (tmp_path / "mod.pyc").write_text("text but compiled\n")
    (tmp_path / "kept.py").write_text("KEPT = 1\n")
    assert list(changed_files({}, tmp_path)) == ["kept.py"]


def test_changed_files_never_follows_a_link_out_of_the_workspace(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    canary = host / "secret.py"
    canary.write_text("HOST_SECRET = 'canary'\n")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "leak.py").symlink_to(canary)
    (workspace / "linked_dir").symlink_to(host, target_is_directory=True)
    (workspace / "inner.py").write_text("A = 1\n")
    (workspace / "alias.py").symlink_to(workspace / "inner.py")  # a link inside is skipped too
    os.mkfifo(workspace / "pipe.py")  # opening a FIFO must not block
    changes = changed_files({}, workspace)
    assert changes == {"inner.py": (None, "A = 1\n")}
    assert all("canary" not in new for _, new in changes.values())
    assert canary.read_text() == "HOST_SECRET = 'canary'\n"


# ---- style --------------------------------------------------------------------
def test_new_lines_by_difflib():
    old = "a\nb\nc\n"
    assert new_lines(old, "a\nB\nc\nd\n") == {2, 4}
    assert new_lines(old, old) == set()
    assert new_lines(old, "c\n") == set()  # deletions add nothing
    assert new_lines(None, "x\ny\n") == {1, 2}


def test_an_unused_import_counts_only_on_a_new_line():
    # ORIGINAL's `import os` is unused already: the model did not add it
    fixed = ORIGINAL.replace("a - b", "a + b")
    assert style_issues({"calc.py": (ORIGINAL, fixed)}) == []
    added = "import sys\n" + fixed  # line 1 is new, the old import is now line 2
    assert style_issues({"calc.py": (ORIGINAL, added)}) == ["calc.py:1: 'sys' imported but unused"]
    # a new file: every line is new, so the old-looking import counts too
    assert style_issues({"calc.py": (None, fixed)}) == ["calc.py:1: 'os' imported but unused"]
    assert style_score({"calc.py": (ORIGINAL, added)}) == -1.0


def test_a_file_that_does_not_parse_is_one_issue():
    broken = "def f(:\n    pass\nimport sys\n"
    assert style_issues({"bad.py": (None, broken)}) == ["bad.py:1: syntax error: invalid syntax"]
    # a deletion that breaks the parse adds no line, yet counts
    assert len(style_issues({"calc.py": (ORIGINAL, ORIGINAL.replace("    return a - b\n", ""))})) == 1
    assert style_issues({"nul.py": (None, "x = 1\x00\n")})[0].startswith("nul.py:1: ")


def test_only_python_files_are_checked():
    assert style_issues({"notes.md": (None, "import os\n# Let me think\n")}) == []


@pytest.mark.parametrize("comment", [
    "# I think this is right", "# Let me check the edge case", "# I'll fix this later",
    "# Hmm, not sure", "# hmmm", "# Wait, that is wrong", "# wait - the loop is off by one",
    "# Actually, b should be negated", "# Maybe I should use a dict", "# Now I need the total",
    "# we need to figure out the sign", "# Okay so the test wants 3", "# OK, so this works",
    "#LET ME see", "## I need to handle None",
])
def test_reasoning_comments_are_detected(comment):
    assert thinking_comments(f"x = 1  {comment}\n", {1}) == [(1, comment)]


@pytest.mark.parametrize("comment", [
    "# Wait for the child to exit", "# wait-free queue", "# Actually computes the sum",
    "# Returns None when the key is missing", "# Let mean be the average", "# HMAC of the body",
    "# Now inline the helper", "# Maybe-typed result", "# think of a as the left operand",
    "# I/O helpers",
])
def test_documentation_comments_are_not_reasoning(comment):
    assert thinking_comments(f"x = 1  {comment}\n", {1}) == []


def test_reasoning_comments_count_on_new_lines_only_and_not_in_strings():
    old = "x = 1  # Let me keep this\n"
    new = old + "s = '# I think not a comment'\ny = 2  # Hmm, this is new\n"
    assert style_issues({"m.py": (old, new)}) == ["m.py:3: reasoning left in a comment: # Hmm, this is new"]


def test_style_score_is_capped():
    many = "".join(f"import m{i}\n" for i in range(25))
    assert len(style_issues({"m.py": (None, many)})) == 25
    assert style_score({"m.py": (None, many)}) == -10.0
    assert style_score({}) == 0.0


# ---- communication ------------------------------------------------------------
def test_communication_bounds():
    assert communication_score("Fixed add: it subtracted.") == 1.0
    assert communication_score(None) == 0.0
    assert communication_score("  \n ") == 0.0
    assert communication_score("x" * 600) == 1.0
    assert communication_score("x" * 601) == 0.0
    assert communication_score("  " + "x" * 600 + "\n") == 1.0  # measured stripped
    assert communication_score("abc", min_chars=4) == 0.0
    assert communication_score("abcd", min_chars=4, max_chars=4) == 1.0
    with pytest.raises(ValueError, match="1 <= min_chars <= max_chars"):
        communication_score("x", min_chars=5, max_chars=2)


# ---- tool misuse --------------------------------------------------------------
def test_tool_misuse_counts_each_misuse_once():
    events = [
        ToolEvent(None, None, False, "malformed", "not JSON"),
        ToolEvent("rm", {}, False, "unknown_tool", "unknown"),
        ToolEvent("read_file", {"path": 1}, False, "bad_arguments", "type"),
        ToolEvent("run", {"command": "cat a"}, True, "terminal_for_dedicated"),
        ToolEvent("read_file", {"path": "a"}, True),
        ToolEvent("read_file", {"path": "nope"}, False, None, "no file"),  # an error, not a misuse
        ToolEvent("finish", {"message": "m"}, True),
        ToolEvent("finish", None, False, "unfinished_todo", "1 to-do items are open at finish"),
    ]
    assert tool_misuse_score(events, open_todo_items=1) == -5.0  # the open item is the event, once
    assert tool_misuse_score([], open_todo_items=0) == 0.0
    no_call = [ToolEvent(None, None, False, "no_tool_call", "the reply has no tool call")]
    assert tool_misuse_score(no_call, open_todo_items=0) == -1.0
    assert tool_misuse_score(no_call, open_todo_items=2) == -2.0  # ended itself with items open
    cut = [ToolEvent("list_dir", {}, True)]
    assert tool_misuse_score(cut, open_todo_items=3) == 0.0  # stopped by a limit: not its choice


def test_tool_misuse_from_what_toolset_respond_emits(tmp_path):
    tools = ToolSet(tmp_path)
    events = []
    for reply in ['<tool_call>{"name": "todo", "arguments": {"items": [{"text": "fix", "done": false}]}}</tool_call>',
                  '<tool_call>{"name": "read_file"}</tool_call>',
                  '<tool_call>{"name": "ls", "arguments": {}}</tool_call>',
                  '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>']:
        events += tools.respond(reply).events
    assert [e.misuse for e in events] == [None, "malformed", "unknown_tool", None, "unfinished_todo"]
    assert tool_misuse_score(events, tools.open_todo_items()) == -3.0


# ---- tool use: batching and redundancy ----------------------------------------------
def ev(name, ok=True, misuse=None, output="", **arguments):
    return ToolEvent(name, arguments, ok, misuse, output=output)


def test_parallel_tool_calls_by_hand():
    messages = [
        [ev("read_file", path="a"), ev("read_file", path="b"), ev("list_dir")],  # one batch of 3: saves 2
        [ev("edit_file", path="a", search="x", replace="y")],  # not read-only: not counted
        [ev("read_file", path="a")],  # a batch of 1: saves 0
        [ev("grep", pattern="x"), ev("read_file", ok=False, misuse="bad_arguments", path=3),
         ev("grep", pattern="y")],  # the misuse splits them: two batches of 1
        [ev("read_file", path="c"), ev("write_file", path="c", content=""), ev("read_file", path="c"),
         ev("list_dir", ok=False, path="nope")],  # 1, then a batch of 2 (a failed read still ran): saves 1
        [ev(None, ok=False, misuse="malformed")],
    ]
    # N = 3 + 1 + 2 + 3 = 9 read-only calls that ran; B = 2 + 0 + 0 + 0 + 0 + 1 = 3
    assert parallel_tool_calls_score(messages) == 3 / 9
    assert parallel_tool_calls_score([[ev("read_file", path="a")], [ev("read_file", path="b")]]) == 0.0
    assert parallel_tool_calls_score([]) == 0.0 and parallel_tool_calls_score([[ev("run_tests")]]) == 0.0


FAIL, PASS = "0 passed, 1 failed, 0 errors of 1 tests\n...", "2 passed, 0 failed, 0 errors of 2 tests"


def test_tool_efficiency_by_hand():
    events = [
        ev("list_dir"),  # 0
        ev("read_file", path="a.py"),  # 0
        ev("read_file", path="./a.py"),  # 1 reread
        ev("list_dir", path="/workspace"),  # 2 relist ("." again)
        ev("read_file", path="b.py", ok=False, output="error: no file"),  # 0 (fails: b.py not read)
        ev("read_file", path="b.py", ok=False),  # 0
        ev("run_tests", output=FAIL),  # 0
        ev("run_tests", output=FAIL),  # 3 retest
        ev("read_file", path="a.py", misuse="bad_arguments", ok=False),  # not run: not counted here
        ev("edit_file", path="a.py", ok=False),  # a failed edit changes nothing: 0
        ev("run_tests", output=FAIL),  # 4 retest
        ev("edit_file", path="a.py"),  # 0, and a change: everything may be new again
        ev("read_file", path="a.py"),  # 0
        ev("list_dir"),  # 0
        ev("run_tests", output=PASS),  # 0: solved from here
        ev("read_file", path="c.py"),  # 5 after solving
        ev("todo", items=[]),  # exempt
        ev(None, ok=False, misuse="malformed"),  # not a call
        ev("finish", message="m"),  # exempt
    ]
    assert tool_efficiency_score(events) == -5.0


def test_tool_efficiency_solved_ends_at_a_change_and_needs_all_tests():
    events = [ev("run_tests", output=PASS), ev("run", command="echo"),  # 1: after solving, and a change
              ev("read_file", path="a"), ev("run_tests", output="3 passed, 0 failed, 0 errors of 4 tests"),
              ev("read_file", path="b"),  # 0: 3 of 4 is not solved
              ev("run_tests", output="0 passed, 0 failed, 0 errors of 0 tests"),  # 2: retest
              ev("run_tests", output="2 passed, 0 failed, 0 errors of 2 tests (timed out)")]  # 3: retest
    assert tool_efficiency_score(events) == -3.0
    assert tool_efficiency_score([]) == 0.0


def test_tool_use_terms_from_what_toolset_respond_emits(tmp_path):
    from megatron_composer.data.tool_calls import format_tool_call, format_tool_calls

    (tmp_path / "a.py").write_text("a = 1\n")
    tools = ToolSet(tmp_path, run_tests=lambda: PASS)
    replies = [format_tool_calls([("read_file", {"path": "a.py"}), ("list_dir", {})]),
               format_tool_call("read_file", {"path": "a.py"}),  # reread
               format_tool_call("run_tests", {}),
               format_tool_call("list_dir", {}),  # after solving (and a relisting): counted once
               format_tool_call("finish", {"message": "ok"})]
    messages = [tools.respond(reply).events for reply in replies]
    assert parallel_tool_calls_score(messages) == 1 / 4  # batches 2, 1, 1: B = 1, N = 4
    assert tool_efficiency_score([e for m in messages for e in m]) == -2.0


# ---- the registry -------------------------------------------------------------
def test_the_behaviour_terms_are_registered_and_read_the_sample():
    spec = ("correctness=1,all_pass=0.5,style=0.1,communication=0.2,tool_misuse=0.05,"
            "parallel_tool_calls=0.3,tool_efficiency=0.1")
    weights = parse_reward_weights(spec)
    assert weights == {"correctness": 1.0, "all_pass": 0.5, "style": 0.1, "communication": 0.2,
                       "tool_misuse": 0.05, "parallel_tool_calls": 0.3, "tool_efficiency": 0.1}
    assert {"all_pass", "style", "communication", "tool_misuse", "parallel_tool_calls",
            "tool_efficiency"} <= set(REWARD_TERMS)
    sample = SimpleNamespace(correctness=0.5, all_pass=False, style=-2.0, communication=1.0, tool_misuse=-3,
                             parallel_tool_calls=0.5, tool_efficiency=-4.0)
    total, per_term = score([sample], weights)
    assert per_term["all_pass"].tolist() == [0.0] and per_term["tool_misuse"].tolist() == [-3.0]
    assert per_term["parallel_tool_calls"].tolist() == [0.5] and per_term["tool_efficiency"].tolist() == [-4.0]
    assert total.item() == pytest.approx(0.5 + 0.0 - 0.2 + 0.2 - 0.15 + 0.15 - 0.4)
    with pytest.raises(ValueError, match="reads sample.style, which SimpleNamespace lacks"):
        score([SimpleNamespace(correctness=1.0)], {"style": 1.0})
