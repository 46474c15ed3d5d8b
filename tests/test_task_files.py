"""Single-turn code tasks from files: the loaders on valid and malformed files, and the sandboxed scoring
against hand-known passing and failing completions. The scoring tests need bubblewrap (as test_sandbox)."""
from __future__ import annotations

import json

import pytest

from megatron_composer.rl.arguments import parse_rl_args
from megatron_composer.rl.tasks import TASKS, build_task
from megatron_composer.rl.tasks.code_harness import unit_count
from megatron_composer.rl.tasks.code_tests import EXAMPLE_TASKS, CodeTestsTask, program_of, run_code_tests
from megatron_composer.rl.tasks.task_files import MAX_LINE_BYTES, CodeTask, load_code_tasks

GOOD = {"id": "add", "prompt": "Write add(a, b).", "tests": "assert add(1, 2) == 3\nassert add(0, 0) == 0\n",
        "entry_point": "add"}

# HumanEval's and MBPP's own field names and shapes (hand-written records in their style)
HUMANEVAL = {"task_id": "HumanEval/0", "prompt": 'def inc(x: int) -> int:\n    """x plus one."""\n',
             "canonical_solution": "    return x + 1\n", "entry_point": "inc",
             "test": "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
                     "    assert candidate(-1) == 0\n    assert candidate(10) == 11\n"}
MBPP = {"task_id": 7, "text": "Write a function to reverse a list.", "code": "def rev(xs):\n    return xs[::-1]",
        "test_list": ["assert rev([1, 2]) == [2, 1]", "assert rev([]) == []", "assert len(rev([3])) == 1"],
        "test_setup_code": "", "challenge_test_list": []}


def _write(path, lines: list) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
    return str(path)


# ---- loaders --------------------------------------------------------------------------------------------
def test_example_file_loads_every_task():
    tasks, problems = load_code_tasks(EXAMPLE_TASKS)
    assert [t.id for t in tasks] == ["add", "is_palindrome", "word_counts", "clamp"] and problems == []
    assert tasks[2].setup == "from collections import Counter" and tasks[2].timeout_s == 5.0


def test_humaneval_and_mbpp_load_without_conversion(tmp_path):
    (he,), _ = load_code_tasks(_write(tmp_path / "he.jsonl", [HUMANEVAL]), "humaneval")
    assert (he.id, he.entry_point, he.code_prefix, he.reference) == ("HumanEval/0", "inc", HUMANEVAL["prompt"],
                                                                   "    return x + 1\n")
    assert unit_count(he.tests) == 3 and HUMANEVAL["prompt"].rstrip() in he.prompt
    (mb,), _ = load_code_tasks(_write(tmp_path / "mbpp.jsonl", [MBPP]), "mbpp")
    assert (mb.id, mb.entry_point, unit_count(mb.tests)) == ("7", "rev", 3)
    assert MBPP["text"] in mb.prompt and MBPP["test_list"][0] in mb.prompt
    sanitized = {"task_id": 8, "prompt": "Write a function gcd2(a, b).", "code": "import math\ndef gcd2(a, b): ...",
                 "test_imports": ["import math"], "test_list": ["assert gcd2(4, 6) == math.gcd(4, 6)"]}
    (sa,), _ = load_code_tasks(_write(tmp_path / "sanitized.jsonl", [sanitized]), "mbpp")
    assert (sa.entry_point, sa.setup) == ("gcd2", "import math") and sanitized["prompt"] in sa.prompt
    assert run_code_tests(sa, program_of(sa, "def gcd2(a, b):\n    return math.gcd(a, b)\n"), 10.0) == (1, 1)


def test_unit_kinds_are_counted_by_hand():
    assert unit_count("x = 1\nassert x\nassert x == 1\n") == 2  # top-level asserts
    assert unit_count("def check(candidate):\n    y = 2\n    assert candidate(y)\n") == 1
    # HumanEval/32's shape: setup, then a loop of asserts, one unit
    assert unit_count("def check(candidate):\n    import math\n    for x in range(3):\n        assert x >= 0\n") == 1
    assert unit_count("for x in (1, 2):\n    assert x\nif True:\n    assert 1\nprint(0)\n") == 2
    assert unit_count("def helper():\n    assert 0\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n") == 2


def test_parquet_and_directory_of_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    _write(shards / "a.jsonl", [GOOD])
    pq.write_table(pa.Table.from_pylist([dict(GOOD, id="sub", tests="assert sub(3, 1) == 2", entry_point="sub"),
                                         dict(GOOD, id="z", entry_point=None)]), shards / "b.parquet")
    (shards / "notes.txt").write_text("not a shard")
    tasks, problems = load_code_tasks(shards)
    assert [t.id for t in tasks] == ["add", "sub"]
    assert len(problems) == 1 and problems[0].startswith(f"{shards / 'b.parquet'}:row 2: missing 'entry_point'")


def test_bad_records_are_counted_with_location_and_fix(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [
        GOOD,                                                    # 1 valid
        b"{not json\n",                                          # 2
        b"[1, 2]\n",                                             # 3 not an object
        {k: v for k, v in GOOD.items() if k != "tests"} | {"id": "b"},  # 4 missing tests
        dict(GOOD, id="c", tests=42),                            # 5 wrong type
        dict(GOOD, id="d", entry_point="not a name"),            # 6
        dict(GOOD, id="e", tests="assert (("),                  # 7 does not parse
        dict(GOOD, id="f", tests="x = 1"),                       # 8 nothing to score
        dict(GOOD, id="g", timeout_s=-1),                        # 9
        dict(GOOD, id="h", timeout_s=True),                      # 10 a bool is no number
        b'{"id": "\xff\xfe"}\n',                                 # 11 not UTF-8
        b"   \n",                                                # 12 blank: not a record
        dict(GOOD, id="i", prompt="x" * (MAX_LINE_BYTES + 10)),  # 13 huge line
        GOOD,                                                    # 14 duplicate id
        dict(GOOD, id="ok2"),                                    # 15 valid
        b"[" * 100000 + b"\n",                                   # 16 nesting past the parser's limit
    ])
    tasks, problems = load_code_tasks(path)
    assert [t.id for t in tasks] == ["add", "ok2"]
    lines = [int(p.split(":")[1]) for p in problems]
    assert lines == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 16]
    by_line = dict(zip(lines, problems))
    assert "not JSON" in by_line[2] and "a JSON object is expected, got list" in by_line[3]
    assert "missing 'tests'" in by_line[4] and "'tests' is int 42, expected a string" in by_line[5]
    assert "not a Python identifier" in by_line[6] and "does not parse" in by_line[7]
    assert "no assert statement or test function" in by_line[8]
    assert "'timeout_s' -1" in by_line[9] and "'timeout_s' True" in by_line[10]
    assert "not UTF-8 (byte 0xff at column 9); re-encode" in by_line[11]
    assert f"over the {MAX_LINE_BYTES}-byte limit" in by_line[13] and "duplicate id 'add'" in by_line[14]
    assert all("; " in p for p in problems)  # every problem names its fix


def test_no_valid_record_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"(?s)has no valid task; 2 bad record\(s\).*:1: .*\n.*:2: missing 'prompt'"):
        load_code_tasks(_write(tmp_path / "t.jsonl", [b"nope\n", {"id": "x"}]))
    with pytest.raises(ValueError, match="has no valid task; 0 bad"):
        load_code_tasks(_write(tmp_path / "empty.jsonl", []))
    with pytest.raises(ValueError, match="'test_list' is None, expected a non-empty list of assert strings"):
        load_code_tasks(_write(tmp_path / "he.jsonl", [HUMANEVAL]), "mbpp")  # the wrong format's records
    with pytest.raises(ValueError, match="does not exist"):
        load_code_tasks(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="--task-format 'csv'"):
        load_code_tasks(EXAMPLE_TASKS, "csv")


def test_flags_select_the_file_task():
    run = parse_rl_args(["--task-file", str(EXAMPLE_TASKS)])
    assert (run.rl.environment.task, run.rl.environment.task_format) == ("code-tests", "jsonl")
    assert isinstance(build_task(run.rl.environment), TASKS["code-tests"])
    with pytest.raises(ValueError, match="--task-file is read by --task code-tests"):
        parse_rl_args(["--task", "complete-function", "--task-file", str(EXAMPLE_TASKS)])
    with pytest.raises(ValueError, match="--task-file is read by --task code-tests"):
        parse_rl_args(["--task", "code-tests"])
    with pytest.raises(ValueError, match="--task-file holds single-turn tasks"):
        parse_rl_args(["--env", "agentic-coding", "--task-file", str(EXAMPLE_TASKS)])
    with pytest.raises(ValueError, match="with --env agentic-coding must hold SWE instances .* no valid instance"):
        parse_rl_args(["--env", "agentic-coding", "--eval-task-file", str(EXAMPLE_TASKS)])
    with pytest.raises(ValueError, match="--eval-task-file is evaluated by the synchronous loop"):
        parse_rl_args(["--async-rl", "--eval-task-file", str(EXAMPLE_TASKS)])
    with pytest.raises(ValueError, match="--task-selection solve-rate runs in the synchronous loop"):
        parse_rl_args(["--async-rl", "--task-selection", "solve-rate"])


# ---- scoring in the sandbox ------------------------------------------------------------------------------
def _task(**overrides) -> CodeTask:
    fields = dict(id="add", prompt="", tests="assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
                  "assert add(0, 0) == 0\nassert add(2, 5) == 7\n", entry_point="add")
    return CodeTask(**{**fields, **overrides})


def test_scoring_hand_known_completions():
    task = CodeTestsTask(str(EXAMPLE_TASKS), timeout_s=5.0)
    prompt = {p.key: p for p in task.prompts()}
    verify = lambda key, text: task.verify(prompt[key], text)  # noqa: E731
    assert verify("add", "```python\ndef add(a, b):\n    return a + b\n```") == {"correctness": 1.0, "all_pass": 1.0}
    # add(1,2)=-1, add(-1,1)=-2, add(0,0)=0, add(2,5)=-3: one of four asserts holds
    assert verify("add", "```python\ndef add(a, b):\n    return a - b\n```") == {"correctness": 0.25, "all_pass": 0.0}
    for wrong in ("def add(a, b):\n    pass\n", "def add(a, b):\n    return None\n", "def add(a, b):\n    return (\n",
                  "I cannot do that.", "def plus(a, b):\n    return a + b\n"):
        assert verify("add", wrong) == {"correctness": 0.0, "all_pass": 0.0}, wrong
    # check(candidate): 'Level' needs the case folded; this one passes 'ab' and '' only
    assert verify("is_palindrome", "def is_palindrome(s):\n    return s == s[::-1]\n") == {
        "correctness": 2 / 3, "all_pass": 0.0}
    # test functions, with the task's setup (Counter) in the namespace
    assert verify("word_counts", "def word_counts(t):\n    return Counter(t.split())\n")["all_pass"] == 1.0
    assert verify("word_counts", "def word_counts(t):\n    return Counter(t)\n") == {"correctness": 0.5,
                                                                                      "all_pass": 0.0}


def test_humaneval_body_continues_the_prompt(tmp_path):
    (task,), _ = load_code_tasks(_write(tmp_path / "he.jsonl", [HUMANEVAL]), "humaneval")
    assert run_code_tests(task, program_of(task, task.reference), 10.0) == (3, 3)
    assert run_code_tests(task, program_of(task, "def inc(x):\n    return x * 2\n"), 10.0) == (1, 3)  # 1*2 == 2


def test_hostile_completions_score_nothing_they_did_not_pass():
    forged = ("import sys, os\nfor i in range(4):\n    print('0' * 32, i, 'pass')\n    os.write(1, b'x 0 pass\\n')\n"
              "def add(a, b):\n    return 0\n")
    # add(-1, 1) == 0 and add(0, 0) == 0 hold, the others not; its printed verdicts count for nothing
    assert run_code_tests(_task(), forged, 10.0) == (2, 4)
    exits = "import os\ndef add(a, b):\n    os._exit(0)\n"
    assert run_code_tests(_task(), exits, 10.0) == (0, 4)
    flood = "def add(a, b):\n    print('y' * 10**6)\n    return a + b\n"
    assert run_code_tests(_task(), flood, 10.0) == (4, 4)  # its output never reaches the verdict pipe
    hang = "def add(a, b):\n    if a == 2:\n        while True: pass\n    return a + b\n"
    assert run_code_tests(_task(), hang, 2.0) == (3, 4)  # the units before the wall clock count
    reads = "import os\nSECRET = os.listdir('/workspace') + os.listdir('/tmp')\ndef add(a, b):\n    return a + b\n"
    assert run_code_tests(_task(tests="assert add(1, 2) == 3\nassert SECRET == []\n"), reads, 10.0) == (2, 2)
    raises = "raise SystemExit(0)\n"
    assert run_code_tests(_task(), raises, 10.0) == (0, 4)


# ---- held-out evaluation (--eval-task-file) --------------------------------------------------------------
class _AnswerBackend:
    """Answers each prompt by the task it names: greedy (temperature 0) and the k samples (by seed order)."""

    def __init__(self, tokenizer, answers):
        self.tok, self.answers = tokenizer, answers

    def generate(self, prompts, params):
        from megatron_composer.inference.params import Completion

        (prompt,) = prompts
        text = self.tok.decode(prompt)
        greedy, sampled = next(v for k, v in self.answers.items() if f"`{k}(" in text)
        answer = greedy if params.temperature == 0 else sampled[params.seed % 2]
        ids = self.tok.encode(f"```python\n{answer}```") + [self.tok.chat["end"]]
        return [Completion(list(prompt), ids, [-0.5] * len(ids), [-0.5] * len(ids), None, [0] * len(ids), "stop")]


def test_held_out_pass_at_1_and_pass_at_k_by_hand():
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.environments import build_environment
    from megatron_composer.rl.rollout import sample_seed
    from tests.agent_fakes import CharTokenizer

    wrong, add_ok = "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n"
    clamp_ok = "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n"
    # the two pass@k samples of task i are seeded sample_seed(0, i, j, 2); the backend picks by seed parity
    assert [sample_seed(0, 0, j, 2) % 2 for j in range(2)] == [0, 1]
    answers = {"add": (wrong, (wrong, add_ok)), "clamp": (clamp_ok, (clamp_ok, clamp_ok)),
               "is_palindrome": ("pass\n", ("pass\n", "pass\n")), "word_counts": ("pass\n", ("pass\n", "pass\n"))}
    rl = RLConfig.from_flat(eval_task_file=str(EXAMPLE_TASKS), eval_pass_k=2, max_new_tokens=400, sandbox_timeout_s=5.0)
    tok = CharTokenizer()
    env = build_environment(rl, tok, 4096, split="eval")
    row = env.evaluate(_AnswerBackend(tok, answers), workers=4)
    # greedy: clamp passes (1 of 4), add scores 1/4 of its asserts; sampled: add's second and clamp's pass
    assert row == {"eval pass@1": 0.25, "eval correctness": (0.25 + 1.0) / 4, "eval solved": 0.25,
                   "eval pass@k": 0.5, "eval tasks": 4.0}
    halves = [env.evaluate(_AnswerBackend(tok, answers), workers=2, shard=(r, 2)) for r in range(2)]
    assert [h["eval tasks"] for h in halves] == [2.0, 2.0]  # add, word_counts | is_palindrome, clamp
    train = build_environment(rl.replace(task="code-tests", task_file=str(EXAMPLE_TASKS)), tok, 4096)
    assert train.evaluate(None, workers=1) is None  # the training pool has no held-out evaluation


def test_a_loop_of_asserts_is_one_unit_after_its_setup():
    task = _task(entry_point="inc", tests="def check(candidate):\n    import math\n    for x in range(3):\n"
                                          "        assert candidate(x) == x + 1\n    assert candidate(10) == 11\n")
    assert run_code_tests(task, "def inc(x):\n    return x + 1\n", 10.0) == (2, 2)
    assert run_code_tests(task, "def inc(x):\n    return x + 1 if x != 10 else 0\n", 10.0) == (1, 2)
    assert run_code_tests(task, "def inc(x):\n    return x + 1 if x < 2 else 0\n", 10.0) == (0, 2)
    setup_fails = _task(entry_point="inc", tests="import no_such_module\nassert inc(1) == 2\n")
    assert run_code_tests(setup_fails, "def inc(x):\n    return x + 1\n", 10.0) == (0, 1)
