"""The swe task family: SWE-bench style instances from a JSONL file, verified by FAIL_TO_PASS / PASS_TO_PASS."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from megatron_composer.data.tool_calls import format_tool_call
from megatron_composer.rl.agent import Agent, AgentConfig
from megatron_composer.rl.agentic import AgenticCodingEnv
from megatron_composer.rl.arguments import parse_rl_args
from megatron_composer.rl.sft_trajectories import expert_steps
from megatron_composer.rl.tasks.coding import apply_solution, family_tasks, prepare_workspace, run_tests, solved_files
from megatron_composer.rl.tasks.coding.swe import EMBEDDED, load_swe_tasks
from megatron_composer.rl.tasks.task_files import MAX_LINE_BYTES
from tests.agent_fakes import CharTokenizer, ScriptedClient

EXAMPLES = EMBEDDED.parent
TOK = CharTokenizer()
CONFIG = AgentConfig(max_context_tokens=16384, max_turn_tokens=4096, max_observation_tokens=4096, max_turns=8)

# A "fix" per instance that makes its FAIL_TO_PASS pass but breaks a PASS_TO_PASS test, with the
# PASS_TO_PASS fraction it leaves (worked out by hand from the tests).
BREAKING_FIXES = {
    "swe/tally-median-even": ("tally/stats.py", "    if len(ordered) % 2:\n        return ordered[mid]\n"
                              "    return (ordered[mid] + ordered[mid + 1]) / 2\n",
                              "    return (ordered[mid - 1] + ordered[mid]) / 2\n", 2 / 3),
    "swe/tally-histogram-negative": ("tally/stats.py", "bucket = int(v / width)",
                                     "bucket = int(v // width) if v < 0 else 0", 1 / 2),
    "swe/tally-slugify-digits": ("tally/text.py", "ch if ch.isalpha() else", "ch if ch.isalnum() or ch == ',' else",
                                 1 / 2),
}


def _all_embedded():
    return family_tasks("swe", "train") + family_tasks("swe", "eval")


def _verdict(task, tmp_path, name, edit=None, solve=False):
    workspace = tmp_path / name
    prepare_workspace(task, workspace)
    if solve:
        apply_solution(task, workspace)
    if edit:
        path, search, replace = edit
        text = (workspace / path).read_text()
        assert text.count(search) == 1
        (workspace / path).write_text(text.replace(search, replace))
    return run_tests(task, workspace)


def test_embedded_set_reference_resolves_unsolved_and_p2p_breaking_fixes_do_not(tmp_path):
    tasks = _all_embedded()
    assert len(tasks) == 4 and family_tasks("swe", "eval")  # both splits hold instances
    for task in tasks:
        assert task.fail_to_pass and task.pass_to_pass and task.solution and task.key.startswith("swe/tally-")
        solved = _verdict(task, tmp_path, task.key[4:] + "-solved", solve=True)
        assert (solved.resolved, solved.fail_to_pass, solved.pass_to_pass) == (True, 1.0, 1.0), solved.output
        unsolved = _verdict(task, tmp_path, task.key[4:] + "-unsolved")
        assert (unsolved.resolved, unsolved.fail_to_pass, unsolved.pass_to_pass) == (False, 0.0, 1.0), unsolved.output
        if task.key in BREAKING_FIXES:
            *edit, p2p = BREAKING_FIXES[task.key]
            broken = _verdict(task, tmp_path, task.key[4:] + "-broken", edit=edit)
            assert (broken.resolved, broken.fail_to_pass) == (False, 1.0), broken.output
            assert broken.pass_to_pass == pytest.approx(p2p)


def test_each_instance_differs_from_the_fixed_package_in_one_injected_line():
    fixed = [solved_files(t) for t in _all_embedded()]
    assert all(f == fixed[0] for f in fixed)  # one package, four bugs
    for task in _all_embedded():
        changed = [p for p in task.files if task.files[p] != fixed[0][p]]
        assert len(changed) == 1 and task.tests == {p: task.files[p] for p in ("tests/test_stats.py", "tests/test_text.py")}
        diff = [(a, b) for a, b in zip(task.files[changed[0]].splitlines(), fixed[0][changed[0]].splitlines()) if a != b]
        assert len(diff) == 1, task.key


def test_expert_episode_resolves_and_editing_the_tests_does_not(tmp_path):
    task = family_tasks("swe", "eval")[0]
    env = AgenticCodingEnv(("swe",), split="eval", workdir=str(tmp_path))
    script = [format_tool_call(name, args) for name, args in expert_steps(task)]
    result = env.episode(Agent(ScriptedClient(TOK, script), TOK, CONFIG), task)
    assert {k: result.verdict[k] for k in ("all_pass", "resolved", "fail_to_pass", "pass_to_pass", "correctness")} \
        == {"all_pass": 1.0, "resolved": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0, "correctness": 1.0}
    test_file = task.fail_to_pass[0].partition("::")[0]
    hostile = [format_tool_call("write_file", {"path": test_file, "content": "def test_nothing():\n    pass\n"}),
               format_tool_call("write_file", {"path": "conftest.py", "content": "import pytest\n"
                                               "@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n"
                                               "    pass\n"}),
               format_tool_call("finish", {"message": "Fixed."})]
    result = env.episode(Agent(ScriptedClient(TOK, hostile), TOK, CONFIG), task)
    assert (result.verdict["resolved"], result.verdict["fail_to_pass"], result.verdict["pass_to_pass"]) == (0.0, 0.0, 1.0)


def _instance(repo_dir, iid="x-1", **fields):
    record = {"instance_id": iid, "repo_dir": repo_dir, "problem_statement": "Fix median.",
              "FAIL_TO_PASS": ["tests/test_stats.py::test_median_even_count"],
              "PASS_TO_PASS": ["tests/test_stats.py::test_mean"]}
    record.update(fields)
    return {k: v for k, v in record.items() if v is not None}


def _write(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _repo(tmp_path, name="repo") -> Path:
    repo = tmp_path / name
    shutil.copytree(EXAMPLES / "tally-median-even", repo, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def _tarball(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for info, data in members:
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data else None)
    return path


def _link(name, target, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


def test_malformed_and_hostile_instances_are_counted_with_their_line_and_a_fix(tmp_path):
    _repo(tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (tmp_path / "link-out").symlink_to(outside)
    escaping = _repo(tmp_path, "escaping")
    (escaping / "tally" / "secret.py").symlink_to("/etc/hostname")
    tar_files = [(tarfile.TarInfo(p), (EXAMPLES / "tally-median-even" / p).read_bytes())
                 for p in ("tally/__init__.py", "tally/stats.py", "tally/text.py", "tests/test_stats.py")]
    _tarball(tmp_path / "dotdot.tar.gz", tar_files + [(tarfile.TarInfo("../evil.py"), b"x = 1\n")])
    _tarball(tmp_path / "absolute.tar.gz", tar_files + [(tarfile.TarInfo("/tmp/evil.py"), b"x = 1\n")])
    _tarball(tmp_path / "symlink.tar.gz", tar_files + [_link("tally/leak.py", "../../../etc/passwd")])
    _tarball(tmp_path / "hardlink.tar.gz", tar_files + [_link("tally/leak.py", "../outside.py", tarfile.LNKTYPE)])
    ok = _instance("repo", "ok-1")
    lines = [ok,                                                                          # 1 valid
             "not json",                                                                  # 2
             _instance("repo", "ok-1"),                                                   # 3 duplicate id
             _instance("../elsewhere"),                                                   # 4 traversal
             _instance("/etc"),                                                           # 5 absolute, outside
             _instance("link-out"),                                                       # 6 a link out of the folder
             _instance("escaping"),                                                       # 7 symlink inside escapes
             _instance("dotdot.tar.gz"),                                                  # 8
             _instance("absolute.tar.gz"),                                                # 9
             _instance("symlink.tar.gz"),                                                 # 10
             _instance("hardlink.tar.gz"),                                                # 11
             _instance("repo", FAIL_TO_PASS=["../tests/test_stats.py::test_mean"]),       # 12 traversal in an id
             _instance("repo", FAIL_TO_PASS=["/work/tests/test_stats.py::test_mean"]),    # 13 absolute id
             _instance("repo", FAIL_TO_PASS=["tests/test_absent.py::test_a"]),            # 14 no such file
             _instance("repo", FAIL_TO_PASS=[]),                                          # 15 nothing to fix
             _instance("repo", PASS_TO_PASS=["tests/test_stats.py::test_median_even_count"]),  # 16 in both
             _instance("repo", test_cmd="rm -rf /"),                                      # 17 not pytest
             _instance("repo", test_cmd="pytest --junitxml=/tmp/x.xml"),                  # 18 redirects results
             _instance("repo", base_commit="--output=/tmp/x"),                            # 19 an option, not a hash
             _instance("repo", base_commit="abcd1234"),                                   # 20 not a git repository
             _instance("repo", problem_statement=""),                                     # 21
             _instance("repo", patch="--- a/tally/stats.py\n+++ b/tally/stats.py\n@@ -1,1 +1,1 @@\n-absent\n+x\n"),  # 22
             "x" * (MAX_LINE_BYTES + 10)]                                                 # 23 huge line
    tasks, problems = load_swe_tasks(_write(tmp_path / "swe.jsonl", lines))
    assert [t.key for t in tasks] == ["swe/ok-1"]
    assert len(problems) == len(lines) - 1
    where = str(tmp_path / "swe.jsonl")
    expected = {2: "not JSON", 3: "duplicate instance_id", 4: "outside the task file's folder",
                5: "outside the task file's folder", 6: "outside the task file's folder",
                7: "points outside the repository", 8: "leaves the repository", 9: "not a relative path",
                10: "points outside the repository", 11: "leaves the repository",
                12: "leaves the repository", 13: "not a relative path", 14: "not a test file of the repository",
                15: "non-empty list", 16: "in both FAIL_TO_PASS and PASS_TO_PASS", 17: "is not pytest",
                18: "changes which tests run or where results go", 19: "is not a commit hash",
                20: "is not a git repository", 21: "'problem_statement'", 22: "'patch' does not apply",
                23: f"over the {MAX_LINE_BYTES}-byte limit"}
    for problem, (line, text) in zip(problems, sorted(expected.items())):
        assert problem.startswith(f"{where}:{line}: ") and text in problem and "; " in problem, problem
    with pytest.raises(ValueError, match="has no valid instance; 2 bad instance"):
        load_swe_tasks(_write(tmp_path / "bad.jsonl", [lines[1], lines[3]]))
    with pytest.raises(ValueError, match="is not a file"):
        load_swe_tasks(tmp_path / "absent.jsonl")


def test_tarball_with_an_inner_symlink_and_git_base_commit_load_and_verify(tmp_path):
    repo = _repo(tmp_path)
    (repo / "tally" / "alias.py").symlink_to("stats.py")
    with tarfile.open(tmp_path / "repo.tar.gz", "w:gz") as archive:
        archive.add(repo, arcname=".")
    buggy = next(t for t in _all_embedded() if t.key == "swe/tally-median-even")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "buggy"], check=True)
    buggy_commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "tally" / "stats.py").write_text(solved_files(buggy)["tally/stats.py"])
    subprocess.run(git + ["commit", "-qam", "fixed"], check=True)
    fixed_commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "tally" / "stats.py").write_text("uncommitted = True\n")
    tasks, problems = load_swe_tasks(_write(tmp_path / "swe.jsonl", [
        _instance("repo.tar.gz", "tar-1"), _instance("repo", "git-buggy", base_commit=buggy_commit),
        _instance(str(repo), "git-fixed", base_commit=fixed_commit[:12])]))  # an absolute path inside the folder
    assert problems == ()
    tar_task, git_buggy, git_fixed = tasks
    assert tar_task.files["tally/alias.py"] == tar_task.files["tally/stats.py"] == buggy.files["tally/stats.py"]
    assert git_buggy.files["tally/stats.py"] == buggy.files["tally/stats.py"] and ".git" not in str(list(git_buggy.files))
    assert git_fixed.files["tally/stats.py"] == solved_files(buggy)["tally/stats.py"]
    assert not _verdict(git_buggy, tmp_path, "buggy").resolved
    assert _verdict(git_fixed, tmp_path, "fixed").resolved


def test_flags_select_the_swe_family():
    run = parse_rl_args(["--env", "agentic-coding", "--swe-task-file", str(EMBEDDED)])
    assert (run.rl.environment.task_families, run.rl.environment.swe_task_file) == ("swe", str(EMBEDDED))
    assert parse_rl_args(["--env", "agentic-coding"]).rl.environment.task_families == "write-file"
    with pytest.raises(ValueError, match="--swe-task-file .* is read by the swe family of --env agentic-coding"):
        parse_rl_args(["--swe-task-file", str(EMBEDDED)])
    with pytest.raises(ValueError, match="add --env agentic-coding and swe to --task-families"):
        parse_rl_args(["--env", "agentic-coding", "--task-families", "fix-bug", "--swe-task-file", str(EMBEDDED)])
    env = AgenticCodingEnv(("swe", "fix-bug"), swe_task_file=str(EMBEDDED), count=4)
    assert [t.family for t in env.tasks()] == ["swe", "fix-bug", "swe", "fix-bug"]


class _HeldOutBackend:
    """Plays the expert's calls (`expert_steps`) in the episodes chosen to solve their task and finishes at once
    in the others: greedy episodes (temperature 0) of the tasks in `greedy`, and sample j of task i where
    (i, j) is in `sampled`. The episode of a call is told by its seed, `Agent.run`'s seed x 1000003 + calls."""

    def __init__(self, tasks, greedy, sampled, k):
        from megatron_composer.rl.rollout import sample_seed

        self.tasks, self.greedy, self.sampled = tasks, set(greedy), set(sampled)
        self.episode_of = {sample_seed(0, i, j, k) * 1_000_003 % 2 ** 63: (i, j)
                           for i in range(len(tasks)) for j in range(k)}

    def generate(self, prompts, params):
        from megatron_composer.inference.params import Completion

        (prompt,) = prompts
        text, calls = TOK.decode(prompt), prompt.count(TOK.chat["assistant"]) - 1  # the turns already taken
        i = next(i for i, t in enumerate(self.tasks) if t.instruction in text)
        if params.temperature == 0:
            solves = i in self.greedy
        else:
            solves = self.episode_of[(params.seed - calls) % 2 ** 63] in self.sampled
        steps = expert_steps(self.tasks[i]) if solves else [("finish", {"message": "Nothing to fix."})]
        ids = TOK.encode(format_tool_call(*steps[calls])) + [TOK.chat["end"]]
        return [Completion(list(prompt), ids, [-0.5] * len(ids), [-0.5] * len(ids), None, [0] * len(ids), "stop")]


def test_agentic_held_out_file_pass_at_1_and_pass_at_k_by_hand():
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.environments import build_environment, merge_evaluations

    tasks = list(load_swe_tasks(str(EMBEDDED.resolve()))[0])  # the held-out file's instances, in file order
    assert len(tasks) == 4
    rl = RLConfig.from_flat(env="agentic-coding", eval_task_file=str(EMBEDDED), eval_pass_k=2, max_turns=8,
                            max_new_tokens=4096, sandbox_timeout_s=20.0)
    env = build_environment(rl, TOK, 16384, split="eval")
    assert [t.key for t in env.episodes.tasks()] == [t.key for t in tasks]  # every instance, not a split's
    # greedy: task 0 resolved (1 of 4); samples: task 0's first, task 2's second (2 of 4 tasks); task 3 never
    backend = _HeldOutBackend(tasks, greedy={0}, sampled={(0, 0), (2, 1)}, k=2)
    row = env.evaluate(backend, workers=4)
    assert (row["eval pass@1"], row["eval pass@k"], row["eval tasks"], row["eval solved"]) == (0.25, 0.5, 4.0, 0.25)
    halves = [env.evaluate(backend, workers=2, shard=(r, 2)) for r in range(2)]  # tasks 0, 2 | 1, 3
    assert [(h["eval pass@1"], h["eval pass@k"]) for h in halves] == [(0.5, 1.0), (0.0, 0.0)]
    merged = merge_evaluations(halves)
    assert (merged["eval pass@1"], merged["eval pass@k"], merged["eval tasks"]) == (0.25, 0.5, 4.0)
    train = build_environment(rl.replace(task_families="swe"), TOK, 16384)
    assert train.evaluate(backend, workers=1).get("eval pass@k") is None  # --eval-tasks on families: greedy only
