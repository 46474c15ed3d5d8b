"""The agent loop with a scripted policy: exact masks, counts, stops and self-summarization."""
from __future__ import annotations

import json

import pytest

from tests.agent_fakes import CharTokenizer, ScriptedClient
from megatron_composer.data.sft import render_chat
from megatron_composer.data.tool_calls import format_tool_call, format_tool_calls, render_tool_response
from megatron_composer.rl.agent import SUMMARY_HEADER, SUMMARY_PROMPT, Agent, AgentConfig, system_prompt
from megatron_composer.rl.rewards import EffortWeights, effort
from megatron_composer.rl.tools import ToolSet

TOK = CharTokenizer()
END, USER, ASSISTANT = TOK.chat["end"], TOK.chat["user"], TOK.chat["assistant"]


BASE = dict(max_context_tokens=8192, max_turn_tokens=512, max_observation_tokens=2000)


def config(**overrides) -> AgentConfig:
    """A character tokenizer needs a larger context than the model's defaults."""
    return AgentConfig(**{**BASE, **overrides})


def call(name, **arguments):
    return format_tool_call(name, arguments)


def user_turn(text):
    return [USER, *TOK.encode(text), END, ASSISTANT]


def test_trajectory_ids_masks_and_counts_are_exact(tmp_path):
    write = call("write_file", path="a.txt", content="hi")
    finish = call("finish", message="Done.")
    script = ["I will write it." + write, finish]
    client = ScriptedClient(TOK, script)
    tools = ToolSet(tmp_path)
    traj = Agent(client, TOK, config(max_turns=5)).run(tools, "Create a.txt with hi.")

    assert traj.stop_reason == "finish" and traj.final_message == "Done."
    assert (tmp_path / "a.txt").read_text() == "hi"
    (segment,) = traj.segments
    system = system_prompt(tools.names)
    prompt = render_chat([{"role": "system", "content": system},
                          {"role": "user", "content": "Create a.txt with hi."}], TOK, add_generation_prompt=True)[0]
    assert segment.prompt_ids == prompt
    observation = user_turn(render_tool_response("write_file", "wrote 2 bytes to a.txt"))
    turn1 = TOK.encode(script[0]) + [END]
    turn2 = TOK.encode(finish) + [END]
    assert segment.completion_ids == turn1 + observation + turn2
    assert segment.trained == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert segment.logprobs == [-0.5] * len(turn1) + [0.0] * len(observation) + [-0.5] * len(turn2)
    assert segment.policy_versions == [3] * len(turn1) + [-1] * len(observation) + [3] * len(turn2)
    # the second call's prompt is exactly the first segment so far: nothing re-tokenized
    assert client.prompts[1] == prompt + turn1 + observation
    c = traj.counts
    assert c.thinking_tokens == len("I will write it.") + 2  # prose + the two stop tokens
    assert c.tool_call_tokens == len(write)
    assert c.final_message_tokens == len(finish)
    assert c.tool_output_tokens == len(observation)
    assert (c.tool_calls, c.turns) == (2, 2)
    assert traj.generated_tokens == sum(segment.trained)


def test_a_message_with_a_list_of_calls_keeps_masks_versions_routes_and_counts_exact(tmp_path):
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "b.txt").write_text("BB")
    batch = format_tool_calls([("read_file", {"path": "a.txt"}), ("read_file", {"path": "b.txt"}),
                               ("list_dir", {})])
    extra = call("write_file", path="c.txt", content="C")
    finish = call("finish", message="Done.")
    script = ["Reading." + batch + extra, finish]
    client = ScriptedClient(TOK, script, moe_shape=(1, 2))
    traj = Agent(client, TOK, config(return_routed_experts=True)).run(ToolSet(tmp_path), "task")

    assert traj.stop_reason == "finish"
    (segment,) = traj.segments
    responses = [render_tool_response("read_file", "A"), render_tool_response("read_file", "BB"),
                 render_tool_response("list_dir", "a.txt\nb.txt"),  # listed before the write after it
                 render_tool_response("write_file", "wrote 1 bytes to c.txt")]
    observation = user_turn("\n".join(responses))
    turn1, turn2 = TOK.encode(script[0]) + [END], TOK.encode(finish) + [END]
    assert segment.completion_ids == turn1 + observation + turn2
    assert segment.trained == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert segment.logprobs == [-0.5] * len(turn1) + [0.0] * len(observation) + [-0.5] * len(turn2)
    assert segment.policy_versions == [3] * len(turn1) + [-1] * len(observation) + [3] * len(turn2)
    routes, p = segment.padded_routes(), len(segment.prompt_ids)
    assert (routes[:p + len(turn1) - 1] == 1).all() and (routes[p + len(turn1) - 1:-1] == 2).all()
    assert (routes[-1] == -1).all()
    assert [e.name for e in traj.turns[0].events] == ["read_file", "read_file", "list_dir", "write_file"]
    c = traj.counts
    assert (c.tool_calls, c.turns) == (5, 2)  # four calls in turn 1 (three in one block), finish
    assert c.tool_call_tokens == len(batch) + len(extra)
    assert c.thinking_tokens == len("Reading.") + 2 and c.final_message_tokens == len(finish)
    # the length penalty's call and turn terms see these counts: x = 1 * 5 calls + 10 * 2 turns
    weights = EffortWeights(thinking_tokens=0, tool_call_tokens=0, tool_output_tokens=0, final_message_tokens=0,
                            tool_calls=1, turns=10)
    assert effort(c, weights) == 25.0


def test_malformed_unknown_and_bad_arguments_are_observations_not_crashes(tmp_path):
    script = ['<tool_call>{"name": "read_file", "arguments": [1]}</tool_call>',
              call("rm_rf", path="/"),
              call("read_file", path=7),
              call("read_file", path="../../etc/passwd"),
              call("finish", message="ok")]
    traj = Agent(ScriptedClient(TOK, script), TOK, config()).run(ToolSet(tmp_path), "task")
    kinds = [e.misuse for e in traj.events]
    assert kinds == ["malformed", "unknown_tool", "bad_arguments", None, None]
    assert not traj.events[3].ok and "outside the workspace" in traj.events[3].error
    assert traj.stop_reason == "finish"


def test_stops_at_max_turns_and_token_budget(tmp_path):
    looping = [call("list_dir")] * 10
    traj = Agent(ScriptedClient(TOK, looping), TOK, config(max_turns=3)).run(ToolSet(tmp_path), "t")
    assert traj.stop_reason == "max_turns" and traj.counts.turns == 3
    n = len(call("list_dir")) + 1
    client = ScriptedClient(TOK, looping)
    traj = Agent(client, TOK, config(max_turns=10, max_total_tokens=2 * n + 5)).run(ToolSet(tmp_path), "t")
    assert traj.stop_reason == "token_budget" and traj.generated_tokens == 2 * n + 5
    assert client.params[2].max_tokens == 5  # the last turn only gets what the budget has left
    assert traj.segments[0].completion_ids[-1] == END and traj.segments[0].trained[-1] == 0  # a cut turn is closed


def test_reply_without_a_call_ends_the_trajectory(tmp_path):
    traj = Agent(ScriptedClient(TOK, ["All done, I think."]), TOK, config()).run(ToolSet(tmp_path), "t")
    assert traj.stop_reason == "no_tool_call" and traj.final_message is None
    assert [e.misuse for e in traj.events] == ["no_tool_call"]


def test_self_summarization_triggers_at_the_threshold_and_chains_segments(tmp_path):
    (tmp_path / "big.txt").write_text("x" * 300)
    read = call("read_file", path="big.txt")
    script = [read, "SUMMARY-1", read, "SUMMARY-2", read, call("finish", message="fin")]
    client = ScriptedClient(TOK, script)
    instruction = "Read big.txt."
    tools = ToolSet(tmp_path, max_output_chars=300)
    first_prompt = render_chat([{"role": "system", "content": system_prompt(tools.names)},
                                {"role": "user", "content": instruction}], TOK, add_generation_prompt=True)[0]
    turn = TOK.encode(read) + [END]
    observation = user_turn(render_tool_response("read_file", "x" * 300))
    trigger = len(first_prompt) + len(turn) + len(observation)  # reached exactly after the first tool turn
    config = AgentConfig(max_context_tokens=4 * trigger, summary_trigger_tokens=trigger, max_summaries=2,
                         summary_max_tokens=32, max_observation_tokens=1000)
    traj = Agent(client, TOK, config).run(tools, instruction)

    assert traj.stop_reason == "finish" and traj.summaries == ["SUMMARY-1", "SUMMARY-2"]
    assert len(traj.segments) == 3
    request = user_turn(SUMMARY_PROMPT)
    s0 = traj.segments[0]
    # the summary request comes right after the context reached the trigger, as a user turn of its own
    # (the observation's trailing <|assistant|> header is dropped: no empty assistant turn before it)
    assert observation[-1] == ASSISTANT and request[0] == USER
    assert client.prompts[1] == first_prompt + turn + observation[:-1] + request
    assert s0.completion_ids == turn + observation[:-1] + request + TOK.encode("SUMMARY-1") + [END]
    assert s0.trained == [1] * len(turn) + [0] * (len(observation) - 1 + len(request)) + [1] * 10
    assert s0.summary == "SUMMARY-1"
    # the next segment starts from the system prompt, the task and the summary
    second_prompt = render_chat([{"role": "system", "content": system_prompt(tools.names)},
                                 {"role": "user", "content": f"{instruction}\n\n{SUMMARY_HEADER}SUMMARY-1"}],
                                TOK, add_generation_prompt=True)[0]
    assert traj.segments[1].prompt_ids == second_prompt and client.prompts[2] == second_prompt
    assert traj.segments[2].prompt_ids[-11:-2] == TOK.encode("SUMMARY-2")
    assert traj.counts.turns == 4  # summaries are not task turns


def test_summary_limit_then_context_stop(tmp_path):
    (tmp_path / "big.txt").write_text("y" * 200)
    read = call("read_file", path="big.txt")
    client = ScriptedClient(TOK, [read, "S", read, read, read, read])
    base = len(render_chat([{"role": "system", "content": system_prompt()}, {"role": "user", "content": "t"}],
                           TOK, add_generation_prompt=True)[0])
    config = AgentConfig(max_context_tokens=base + 900, summary_trigger_tokens=base + 100, max_summaries=1,
                         summary_max_tokens=8, max_turns=20, max_observation_tokens=1000)
    traj = Agent(client, TOK, config).run(ToolSet(tmp_path), "t")
    assert traj.summaries == ["S"] and traj.stop_reason == "context"
    assert all(s.length <= base + 900 for s in traj.segments)


def test_routed_experts_keep_the_routing_of_the_call_that_processed_each_token(tmp_path):
    script = [call("list_dir"), call("finish", message="m")]
    client = ScriptedClient(TOK, script, moe_shape=(2, 2))
    traj = Agent(client, TOK, config(return_routed_experts=True)).run(ToolSet(tmp_path), "t")
    (seg,) = traj.segments
    routes = seg.padded_routes()
    assert routes.shape == (seg.length, 2, 2)
    p, first = len(seg.prompt_ids), len(call("list_dir")) + 1
    assert (routes[:p + first - 1] == 1).all()  # prompt and turn 1, processed by call 1
    assert (routes[p + first - 1:-1] == 2).all()  # its last token, the observation and turn 2: call 2
    assert (routes[-1] == -1).all()  # the very last token was never fed back


@pytest.mark.parametrize("trigger, summary", [(0, 8), (900, 200)])
def test_bad_summary_settings_are_refused(trigger, summary):
    with pytest.raises(ValueError, match="summary-trigger-tokens"):
        AgentConfig(max_context_tokens=1024, summary_trigger_tokens=trigger, summary_max_tokens=summary)


def test_scripted_tool_calls_round_trip_through_json():
    text = call("edit_file", path="a.py", search='"x"', replace="'y'\n")
    assert json.loads(text[len("<tool_call>"):-len("</tool_call>")])["arguments"]["search"] == '"x"'


def test_a_long_segment_prompt_gets_a_turn_before_any_summary(tmp_path):
    script = [call("list_dir"), "S1", call("finish", message="f")]
    client = ScriptedClient(TOK, script)
    config_ = config(summary_trigger_tokens=10, summary_max_tokens=8, max_summaries=3)  # below the prompt
    traj = Agent(client, TOK, config_).run(ToolSet(tmp_path), "t")
    # one turn, then the summary; the new segment (also over the trigger) gets a turn before any summary
    assert traj.summaries == ["S1"] and traj.stop_reason == "finish" and traj.counts.turns == 2


def test_summaries_respect_max_turns_and_the_budget(tmp_path):
    client = ScriptedClient(TOK, [call("list_dir"), "SUMMARY" * 20])
    traj = Agent(client, TOK, config(summary_trigger_tokens=10, summary_max_tokens=512, max_turns=1)).run(
        ToolSet(tmp_path), "t")
    assert traj.summaries == [] and traj.stop_reason == "max_turns"
    n = len(call("list_dir")) + 1
    client = ScriptedClient(TOK, [call("list_dir"), "SUMMARY" * 20])
    traj = Agent(client, TOK, config(summary_trigger_tokens=10, summary_max_tokens=512,
                                     max_total_tokens=n + 7)).run(ToolSet(tmp_path), "t")
    assert traj.generated_tokens == n + 7 and client.params[1].max_tokens == 7


def test_segments_never_pass_the_context_even_when_a_turn_is_cut(tmp_path):
    prompt = len(render_chat([{"role": "system", "content": system_prompt()}, {"role": "user", "content": "t"}],
                             TOK, add_generation_prompt=True)[0])
    long_call = call("write_file", path="a.txt", content="z" * 400)
    for context in range(prompt + 20, prompt + 120, 7):
        traj = Agent(ScriptedClient(TOK, [long_call] * 4), TOK, config(max_context_tokens=context)).run(
            ToolSet(tmp_path), "t")
        assert all(s.length <= context for s in traj.segments) and traj.stop_reason == "context"


def test_ids_past_the_vocabulary_do_not_crash_counting(tmp_path):
    class Small(CharTokenizer):
        vocab_size = 200

        def decode(self, ids):
            if any(i >= self.vocab_size for i in ids):
                raise IndexError("piece id is out of range")
            return super().decode(ids)

    small = Small()
    client = ScriptedClient(small, [call("finish", message="ok")])
    original = client.generate

    def with_padding_id(prompts, params):
        (out,) = original(prompts, params)
        out.token_ids.insert(0, 5000)  # a padded-vocabulary id
        out.logprobs.insert(0, -9.0)
        out.policy_versions.insert(0, 3)
        return [out]

    client.generate = with_padding_id
    traj = Agent(client, small, config()).run(ToolSet(tmp_path), "t")
    assert traj.stop_reason == "finish"
    # the odd id decodes to nothing, so it starts where the finish block starts: counted there
    assert traj.counts.final_message_tokens == len(call("finish", message="ok")) + 1
    assert traj.counts.thinking_tokens == 1


def test_bad_summary_room_is_refused_with_the_three_values():
    with pytest.raises(ValueError, match="summary request"):
        Agent(ScriptedClient(TOK, []), TOK, config(max_context_tokens=400, summary_trigger_tokens=200,
                                                   summary_max_tokens=150))
