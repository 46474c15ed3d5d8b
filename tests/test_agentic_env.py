"""The agentic environment end to end: episodes verified in the sandbox, segments packed for the
policy loss, expert SFT trajectories, and `train_rl.py --env agentic-coding`."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megatron_composer.data.sft import read_conversations
from megatron_composer.data.tool_calls import format_tool_call
from megatron_composer.rl.agent import Agent, AgentConfig
from megatron_composer.rl.agentic import AgenticCodingEnv
from megatron_composer.rl.batches import RolloutSample, pack_samples
from megatron_composer.rl.sft_trajectories import (
    expert_conversation,
    expert_messages,
    expert_steps,
    step_text,
    write_sft_jsonl,
)
from megatron_composer.rl.tasks.coding import FAMILIES, load_tasks
from tests.agent_fakes import CharTokenizer, ScriptedClient

TOK = CharTokenizer()
CONFIG = AgentConfig(max_context_tokens=16384, max_turn_tokens=4096, max_observation_tokens=4096, max_turns=8)


def _expert_script(task) -> list[str]:
    return [format_tool_call(name, args) for name, args in expert_steps(task)]


@pytest.fixture(scope="module")
def write_task():
    return load_tasks(["write-file"], "train", count=1)[0]


def test_expert_episode_is_solved_and_scored(write_task, tmp_path):
    env = AgenticCodingEnv(("write-file",), workdir=str(tmp_path))
    result = env.episode(Agent(ScriptedClient(TOK, _expert_script(write_task)), TOK, CONFIG), write_task)
    assert result.trajectory.stop_reason == "finish"
    assert result.verdict["all_pass"] == 1.0 and result.verdict["correctness"] == 1.0
    assert result.verdict["communication"] == 1.0 and result.verdict["tool_misuse"] == 0.0
    assert not list(tmp_path.iterdir())  # the workspace is gone after the episode


def test_hostile_episode_cannot_pass_by_editing_tests_or_planting_conftest(write_task, tmp_path):
    test_path = sorted(write_task.tests)[0]
    script = [format_tool_call("write_file", {"path": "conftest.py", "content":
                                              "import pytest\n@pytest.hookimpl(tryfirst=True)\n"
                                              "def pytest_runtest_call(item):\n    pass\n"}),
              format_tool_call("write_file", {"path": test_path, "content": "def test_ok():\n    pass\n"}),
              format_tool_call("run", {"command": "rm -rf /workspace/* ; echo gone"}),
              format_tool_call("finish", {"message": "All tests pass."})]
    env = AgenticCodingEnv(("write-file",), workdir=str(tmp_path))
    result = env.episode(Agent(ScriptedClient(TOK, script), TOK, CONFIG), write_task)
    assert result.trajectory.stop_reason == "finish"
    assert result.verdict["all_pass"] == 0.0 and result.verdict["correctness"] == 0.0


def test_malformed_calls_are_counted_as_misuse_in_the_verdict(write_task, tmp_path):
    script = ['<tool_call>{"name": "write_file", "arguments": }</tool_call>',
              format_tool_call("cat", {"path": "x"}), format_tool_call("finish", {"message": "done"})]
    env = AgenticCodingEnv(("write-file",), workdir=str(tmp_path))
    result = env.episode(Agent(ScriptedClient(TOK, script), TOK, CONFIG), write_task)
    assert result.verdict["tool_misuse"] == -2.0 and result.verdict["all_pass"] == 0.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expert_trajectories_solve_every_family(family, tmp_path):
    task = load_tasks([family], "train", count=1)[0]
    messages = expert_conversation(task, workdir=str(tmp_path))  # raises unless every call runs and tests pass
    assert messages[0]["role"] == "system" and messages[1] == {"role": "user", "content": task.instruction}
    assert [m["role"] for m in messages[2:]] == ["assistant", "user"] * ((len(messages) - 3) // 2) + ["assistant"]
    assert json.loads(messages[-1]["content"][len("<tool_call>"):-len("</tool_call>")])["name"] == "finish"


@pytest.mark.parametrize("family", ["set-constant", "fix-bug"])
def test_expert_reads_the_files_it_needs_in_one_message(family, tmp_path):
    task = load_tasks([family], "train", count=1)[0]
    assert len(task.reads) == 2
    messages = expert_conversation(task, workdir=str(tmp_path))
    reads = [{"name": "read_file", "arguments": {"path": p}} for p in task.reads]
    assert json.loads(messages[2]["content"][len("<tool_call>"):-len("</tool_call>")]) == reads
    assert messages[3]["content"].count('<tool_response name="read_file">') == 2


def test_sft_jsonl_is_readable_by_the_sft_stage(tmp_path):
    tasks = load_tasks(["write-file", "set-constant"], "train", count=4)
    path = tmp_path / "sft" / "train.jsonl"
    assert write_sft_jsonl(path, tasks, log=None, workdir=str(tmp_path)) == 4
    conversations = read_conversations(path)
    assert len(conversations) == 4 and not (tmp_path / "sft" / "train.jsonl.tmp").exists()


def test_multi_turn_samples_train_only_generated_tokens():
    # prompt [10, 11, 12]; completion: generated 20 21, tool 30 31, generated 22
    s = RolloutSample(0, [10, 11, 12], [20, 21, 30, 31, 22], [-1.0, -2.0, 0.0, 0.0, -3.0], None,
                      [1, 1, -1, -1, 1], "stop", loss_mask=[1, 1, 0, 0, 1], advantage=0.5)
    batch = pack_samples([s])
    # position t predicts token t + 1: trained where the next token was generated
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 0]
    assert batch.labels[0].tolist()[:7] == [11, 12, 20, 21, 30, 31, 22]
    assert batch.sampler_logp[0].tolist() == [0, 0, -1.0, -2.0, 0, 0, -3.0, 0]
    assert batch.advantages[0].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0.5, 0]


def test_train_rl_agentic_env_runs_and_evaluates(data_dir, tmp_path, capsys):
    from train_rl import main

    save = tmp_path / "rl"
    code = main(["--env", "agentic-coding", "--task-families", "write-file", "--model-preset", "tiny",
                 "--num-layers", "2", "--train-iters", "1", "--prompts-per-step", "2", "--group-size", "2",
                 "--max-new-tokens", "24", "--max-turns", "2", "--seq-length", "512",
                 "--rl-micro-batch-tokens", "1024", "--eval-tasks", "2", "--log-interval", "1",
                 "--data-cache-dir", str(data_dir), "--tokenizer-model", str(data_dir / "tokenizer.model"),
                 "--save", str(save)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "RL env agentic-coding (write-file)" in out and "eval at step 0: solved" in out
    assert "eval at step 1: solved" in out and os.path.isfile(save / "reward_curve.png")
    # an explicit --tokenizer-model reaches the checkpoint (CheckpointConfig.tokenizer_model)
    assert (save / "tokenizer.model").read_bytes() == (data_dir / "tokenizer.model").read_bytes()


def test_unknown_family_is_named():
    from megatron_composer.rl.config import RLConfig

    with pytest.raises(ValueError, match="write-files"):
        RLConfig.from_flat(env="agentic-coding", task_families="write-files")


def test_routes_of_segments_cover_every_token(write_task, tmp_path):
    client = ScriptedClient(TOK, _expert_script(write_task), moe_shape=(1, 2))
    config = AgentConfig(**{**CONFIG.__dict__, "return_routed_experts": True})
    env = AgenticCodingEnv(("write-file",), workdir=str(tmp_path))
    (segment,) = env.episode(Agent(client, TOK, config), write_task).trajectory.segments
    routes = segment.padded_routes()
    assert routes.shape[0] == segment.length and routes.dtype == torch.int32


def test_evaluate_reports_summaries_and_their_length(write_task, tmp_path):
    from megatron_composer.data.sft import render_chat
    from megatron_composer.rl.agent import system_prompt
    from megatron_composer.rl.agentic import summarize

    prompt = len(render_chat([{"role": "system", "content": system_prompt()},
                              {"role": "user", "content": write_task.instruction}], TOK, add_generation_prompt=True)[0])
    script = [format_tool_call("list_dir", {}), "I listed the folder.", *_expert_script(write_task)]
    config = AgentConfig(**{**CONFIG.__dict__, "summary_trigger_tokens": prompt + 10, "max_summaries": 1,
                            "summary_max_tokens": 64})
    env = AgenticCodingEnv(("write-file",), workdir=str(tmp_path))
    result = env.episode(Agent(ScriptedClient(TOK, script), TOK, config), write_task)
    assert result.trajectory.summaries == ["I listed the folder."] and result.verdict["all_pass"] == 1.0
    row = summarize([result], TOK)
    assert row["summaries"] == 1.0 and row["summary tokens"] == len("I listed the folder.") and row["solved"] == 1.0
    assert row["stops"] == "finish 1"
    turns = len(script) - 1  # every scripted reply but the summary is a model turn
    assert row["turns"] == row["turns per solved"] == turns and row["tool calls"] == turns
    assert row["calls per turn"] == 1.0 and row["parallel tool calls"] == 0.0


def test_a_batched_expert_episode_counts_its_calls_per_turn(tmp_path):
    from megatron_composer.rl.agentic import summarize
    from megatron_composer.rl.rollout import episode_samples

    task = load_tasks(["set-constant"], "train", count=1)[0]
    steps = expert_messages(task)  # reads (2 in one message), edit, run_tests, finish
    env = AgenticCodingEnv(("set-constant",), workdir=str(tmp_path))
    result = env.episode(Agent(ScriptedClient(TOK, [step_text(s) for s in steps]), TOK, CONFIG), task)
    assert [len(s) for s in steps] == [2, 1, 1, 1] and result.verdict["all_pass"] == 1.0
    assert (result.trajectory.counts.tool_calls, result.trajectory.counts.turns) == (5, 4)
    assert result.verdict["parallel_tool_calls"] == 0.5 and result.verdict["tool_efficiency"] == 0.0
    row = summarize([result], TOK)
    assert row["calls per turn"] == 5 / 4 and row["turns per solved"] == 4.0
    (sample,) = episode_samples([result], [0], 1, TOK)
    assert sample.info["calls per turn"] == 5 / 4 and sample.info["turns"] == 4
    assert sample.effort == result.trajectory.counts


def test_expert_messages_batch_consecutive_reads_up_to_the_cap():
    from types import SimpleNamespace

    edit = SimpleNamespace(path="f0.py", search="a", replace="b")
    task = SimpleNamespace(family="fix-bug", reads=tuple(f"f{i}.py" for i in range(10)), solution=(edit,))
    sizes = [[name for name, _ in m] for m in expert_messages(task)]
    assert sizes == [["read_file"] * 8, ["read_file"] * 2, ["edit_file"], ["run_tests"], ["finish"]]
    assert [c for m in expert_messages(task) for c in m] == expert_steps(task)


def test_gather_tasks_need_every_read_and_score_by_turns(data_dir, tmp_path):
    """A gather task: k = 3-6 files of one word, file i's word one of its own six, none given away by the
    file names; the answer is the words joined by commas; every word is one token of the embedded tokenizer
    in a tool response and in the answer alike; the batched expert solves it in 3 turns (one list of k reads,
    the write, finish), the sequential one in k + 2, both solved; parallel_tool_calls is (k - 1) / k for the
    first and 0 for the second."""
    from megatron_composer.rl.sft_trajectories import sequential_reader
    from megatron_composer.rl.tasks.coding.gather import LISTS

    tasks = load_tasks(["gather"], "train", count=200)
    assert {len(t.reads) for t in tasks} == {3, 4, 5, 6}
    for t in tasks:
        words = [t.files[p].strip() for p in t.reads]
        assert t.reads == tuple(f"{letter}.txt" for letter in "abcdef"[:len(words)])
        assert all(w in LISTS[p[0]] and w not in p for w, p in zip(words, t.reads))
        assert t.solution[0].replace == ",".join(words)
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.rl.agent import system_prompt

    embedded = Tokenizer(data_dir / "tokenizer.model")  # the tiny examples' tokenizer
    ids = {}
    for word in (w for words in LISTS.values() for w in words):
        (ids[word],) = embedded.encode(word)
        assert embedded.encode(f",{word},")[1:-1] == [ids[word]] and embedded.encode(f'">{word}\n')[1:-1] == [ids[word]]
    assert len(set(ids.values())) == 36
    prompt = system_prompt() + "".join(t.instruction for t in tasks)  # no list word is a token of the prompt
    assert not set(ids.values()) & set(embedded.encode(prompt))
    task = dataclasses.replace(next(t for t in tasks if len(t.reads) == 5), test_timeout_s=120.0)  # a loaded machine
    env = AgenticCodingEnv(("gather",), workdir=str(tmp_path))
    for batch, turns, parallel in ((True, 3, 4 / 5), (False, 7, 0.0)):
        steps = expert_messages(task, batch_reads=batch)
        result = env.episode(Agent(ScriptedClient(TOK, [step_text(s) for s in steps]), TOK, CONFIG), task)
        assert result.verdict["all_pass"] == 1.0, (result.verdict, result.tests.output[-2000:])
        assert result.trajectory.counts.turns == turns
        assert result.verdict["parallel_tool_calls"] == pytest.approx(parallel)
        assert result.trajectory.counts.tool_calls == 5 + 2
    chosen = [sequential_reader(t, 0.7) for t in tasks]
    assert 0.6 < sum(chosen) / len(chosen) < 0.8 and chosen == [sequential_reader(t, 0.7) for t in tasks]
    assert not any(sequential_reader(t, 0.0) for t in tasks) and all(sequential_reader(t, 1.0) for t in tasks)


def test_summarized_expert_segments_are_the_agent_loops_own(tmp_path):
    """A sequential gather trajectory cut at a trigger (`summarized_segments`) is what the agent loop makes
    when it replays the expert's messages and summaries at that trigger: the same segments, token for token
    (prompts, summary requests, summaries); the summaries say, by hand, what was read, what is left and what
    was written; the episode is solved; one SFT line per segment."""
    from megatron_composer.data.sft import render_chat
    from megatron_composer.rl.agent import SUMMARY_HEADER, SUMMARY_PROMPT
    from megatron_composer.rl.sft_trajectories import expert_conversation, summarized_segments, write_sft_jsonl

    task = next(t for t in load_tasks(["gather"], "train", count=50) if len(t.reads) == 4)
    task = dataclasses.replace(task, test_timeout_s=120.0)  # a loaded machine (the suite on 2 cores) is slow
    words = [task.files[p].strip() for p in task.reads]
    messages = expert_conversation(task, batch_reads=False, workdir=str(tmp_path))
    prompt = len(render_chat(messages[:2], TOK, add_generation_prompt=True)[0])
    read = len(render_chat(messages[:4], TOK, add_generation_prompt=True)[0]) - prompt  # one read and its answer
    trigger = prompt + 2 * read + 10  # two reads fit, the third starts a summary
    segments = summarized_segments(task, messages, TOK, trigger)
    a, b, c, d = task.reads
    first = f"Read: {a} holds {words[0]}; {b} holds {words[1]}; {c} holds {words[2]}. Left to read: {d}."
    assert segments[0][-2:] == [{"role": "user", "content": SUMMARY_PROMPT}, {"role": "assistant", "content": first}]
    assert segments[1][1]["content"] == f"{task.instruction}\n\n{SUMMARY_HEADER}{first}"
    summaries = [s[-1]["content"] for s in segments[:-1]]
    assert summaries[-1].startswith(f"Read: {a} holds {words[0]}") and summaries[-1].endswith(
        f"{d} holds {words[3]}. Every file is read. Wrote answer.txt.")
    actions = [m["content"] for s in segments for m in s[2:] if m["role"] == "assistant" and m["content"] not in summaries]
    assert actions == [m["content"] for m in messages if m["role"] == "assistant"]

    script = [m["content"] for s in segments for m in s[2:] if m["role"] == "assistant"]
    config = AgentConfig(max_context_tokens=16384, max_turn_tokens=4096, max_observation_tokens=4096, max_turns=8,
                         summary_trigger_tokens=trigger, max_summaries=len(summaries), summary_max_tokens=4096)
    env = AgenticCodingEnv(("gather",), workdir=str(tmp_path))
    result = env.episode(Agent(ScriptedClient(TOK, script), TOK, config), task)
    assert result.verdict["all_pass"] == 1.0, (result.verdict, result.tests.output[-2000:])
    assert result.trajectory.summaries == summaries
    for ours, seg in zip(segments, result.trajectory.segments, strict=True):
        assert render_chat(ours, TOK)[0][:-1] == seg.ids  # the loop's segment: no EOD after the last turn

    out = tmp_path / "segments.jsonl"
    write_sft_jsonl(out, [task], workers=1, log=None, sequential_reads=1.0, summarize=(TOK, trigger))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["segment"] for x in lines] == list(range(len(segments))) and [x["messages"] for x in lines] == segments
