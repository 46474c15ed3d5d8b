"""Tool-call text format: parsing (fuzzed), rendering, OpenAI messages -> chat template messages."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_composer.data.tool_calls import (
    MAX_CALLS_PER_MESSAGE,
    ToolCall,
    ToolFormatError,
    format_tool_call,
    format_tool_calls,
    messages_for_template,
    parse_tool_calls,
    render_tool_response,
    render_tools,
    tool_call_blocks,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

_json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(), inner, max_size=4), max_leaves=12)
_arguments = st.dictionaries(st.text(), _json, max_size=4)


def test_one_call_between_text():
    text = 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    assert parse_tool_calls(text) == ("Let me look.", [ToolCall("get_weather", {"city": "Paris"})], [])


def test_several_calls_and_whitespace_inside_the_tags():
    text = '<tool_call> {"name": "a", "arguments": {}} </tool_call>x<tool_call>\n{"name": "b", "arguments": {"k": [1]}}\n</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert (content, errors) == ("x", [])
    assert calls == [ToolCall("a", {}), ToolCall("b", {"k": [1]})]


def test_closing_tag_inside_a_json_string_does_not_end_the_block():
    arguments = {"code": "print('</tool_call>') # <tool_call>"}
    assert parse_tool_calls(format_tool_call("run", arguments)) == ("", [ToolCall("run", arguments)], [])


@pytest.mark.parametrize("block, problem", [
    ('{"name": "a"}', 'it needs exactly "name" and "arguments"'),
    ('{"name": "a", "arguments": [1]}', '"arguments" is a JSON list'),
    ('{"name": 3, "arguments": {}}', '"name" is 3'),
    ('{"name": "a", "arguments": {}, "id": 1}', "keys ['arguments', 'id', 'name']"),
    ('["a", {}]', "entry 1 of the call list: the call is a JSON str"),
    ("{'name': 'a', 'arguments': {}}", "not valid JSON"),
    ('{"name": "a", "arguments": {"x": NaN}}', "NaN is not JSON"),
    ('{"name": "a", "arguments": {}} and more', "text follows the JSON object"),
])
def test_malformed_blocks_stay_in_the_text_and_are_reported(block, problem):
    text = f"before <tool_call>{block}</tool_call> after"
    content, calls, errors = parse_tool_calls(text)
    assert calls == [] and content == text
    assert len(errors) == 1 and problem in errors[0] and errors[0].startswith("tool call 1:")
    assert '<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>' in errors[0]


def test_unclosed_block():
    content, calls, errors = parse_tool_calls('ok <tool_call>{"name": "a", "arguments": {}}')
    assert calls == [] and "no </tool_call> closes the block" in errors[0]
    assert content == 'ok <tool_call>{"name": "a", "arguments": {}}'


def test_a_bad_block_does_not_hide_the_good_one_after_it():
    text = '<tool_call>oops</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("b", {})] and content == "<tool_call>oops</tool_call>"
    assert errors[0].startswith("tool call 1: not valid JSON")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text() | st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"a"', ",",
                                            '"arguments"', "[", "]", " ", "x"]), max_size=30).map("".join))
def test_parser_never_raises(text):
    content, calls, errors = parse_tool_calls(text)
    assert isinstance(content, str) and all(isinstance(c, ToolCall) for c in calls)
    assert all(isinstance(e, str) for e in errors)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(min_size=1), _arguments, st.text().filter(lambda t: "<tool_call>" not in t))
def test_format_then_parse_round_trips(name, arguments, prose):
    content, calls, errors = parse_tool_calls(prose + format_tool_call(name, arguments))
    assert calls == [ToolCall(name, arguments)] and errors == [] and content == prose.strip()


def test_format_refuses_what_is_not_json():
    with pytest.raises(ToolFormatError, match="must be a dict"):
        format_tool_call("a", [1])
    with pytest.raises(ToolFormatError, match="not JSON-serializable"):
        format_tool_call("a", {"x": float("nan")})


def test_render_tools_lists_each_function_as_json():
    block = render_tools([WEATHER])
    listed = block.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed)["name"] == "get_weather"
    assert "<tool_call>" in block and "<tool_response" in block


@pytest.mark.parametrize("tools, message", [
    ([{"type": "retrieval"}], "only \"function\" tools"),
    ([{"type": "function"}], 'no "function" object'),
    ([{"type": "function", "function": {"name": "bad name"}}], "must match"),
    (["get_weather"], "tools[0] is a str"),
])
def test_render_tools_names_the_bad_entry(tools, message):
    with pytest.raises(ToolFormatError, match=message.replace("[", r"\[")):
        render_tools(tools)


def test_messages_for_template_with_a_tool_round_trip():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "18C and sunny."},
    ]
    out = messages_for_template(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert out[2]["content"] == format_tool_call("get_weather", {"city": "Paris"})
    assert out[3]["content"] == (render_tool_response("get_weather", "18C") + "\n"
                                 + render_tool_response("get_weather", "sunny"))
    assert out[3]["content"].startswith('<tool_response name="get_weather">18C</tool_response>')


def test_messages_for_template_adds_a_system_message_for_tools():
    out = messages_for_template([{"role": "user", "content": "hi"}], [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"] == render_tools([WEATHER])
    assert messages_for_template([{"role": "developer", "content": "x"}]) == [{"role": "system", "content": "x"}]


@pytest.mark.parametrize("message, problem", [
    ({"role": "wizard", "content": "x"}, "role 'wizard'"),
    ({"role": "tool", "tool_call_id": "nope", "content": "x"}, "tool_call_id 'nope'"),
    ({"role": "user", "content": [{"type": "image_url"}]}, "only text content"),
    ({"role": "user", "content": 3}, "content is a int"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{bad"}}]}, "not valid JSON"),
    ("hello", "messages[0] is a str"),
])
def test_messages_for_template_names_the_bad_message(message, problem):
    with pytest.raises(ToolFormatError, match=problem.replace("[", r"\[")):
        messages_for_template([message])


def test_a_reply_with_calls_becomes_openai_tool_calls():
    from megatron_composer.inference.protocol import chat_message

    reply = 'Checking.\n' + format_tool_call("get_weather", {"city": "Paris"}) + format_tool_call("now", {})
    message, called = chat_message(reply, with_tools=True)
    assert called and message["role"] == "assistant" and message["content"] == "Checking."
    calls = message["tool_calls"]
    assert [c["type"] for c in calls] == ["function", "function"] and calls[0]["id"] != calls[1]["id"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("now", {})]
    assert chat_message(format_tool_call("now", {}), with_tools=True)[0]["content"] is None
    assert chat_message(reply, with_tools=False) == ({"role": "assistant", "content": reply}, False)
    broken = "<tool_call>{oops}</tool_call>"
    assert chat_message(broken, with_tools=True) == ({"role": "assistant", "content": broken}, False)


# ---- lists of calls in one block ----------------------------------------------
def test_a_list_block_is_its_calls_in_order():
    text = ('first <tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>'
            ' then <tool_call>{"name": "c", "arguments": {}}</tool_call>')
    content, calls, errors = parse_tool_calls(text)
    assert content == "first  then" and errors == []
    assert calls == [ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {})]
    first, second = tool_call_blocks(text)
    assert first.is_list and first.call is None and len(first.calls) == 2
    assert not second.is_list and second.call == ToolCall("c", {})


def test_format_tool_calls_round_trips_and_refuses_bad_lists():
    pairs = [("read_file", {"path": "a.py"}), ("grep", {"pattern": "x", "path": "."})]
    assert parse_tool_calls(format_tool_calls(pairs))[1] == [ToolCall(n, a) for n, a in pairs]
    with pytest.raises(ToolFormatError, match="1 to 8 calls, got 0"):
        format_tool_calls([])
    with pytest.raises(ToolFormatError, match="got 9"):
        format_tool_calls([("a", {})] * 9)


ONE = '{"name": "a", "arguments": {}}'


@pytest.mark.parametrize("block, problem", [
    ("[]", "the call list is empty"),
    ("[" + ", ".join([ONE] * (MAX_CALLS_PER_MESSAGE + 1)) + "]", "has 9 calls, more than 8"),
    (f"[{ONE}, [{ONE}]]", "entry 2 of the call list is a list; lists of calls do not nest"),
    (f"[[{ONE}]]", "entry 1 of the call list is a list"),
    (f"[{ONE}, 3]", "entry 2 of the call list: the call is a JSON int"),
    (f'[{ONE}, {{"name": "b", "arguments": "x"}}]', 'entry 2 of the call list: "arguments" is a JSON str'),
    (f'[{ONE}, {{"name": "b"}}]', 'entry 2 of the call list: the call has keys'),
    ('"read_file"', "the call is a JSON str, not an object"),
    ("7", "the call is a JSON int"),
    ("null", "the call is a JSON NoneType"),
    (f"[{ONE}", "not valid JSON"),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
])
def test_hostile_call_lists_are_one_malformed_block(block, problem):
    text = f"x <tool_call>{block}</tool_call> y"
    content, calls, errors = parse_tool_calls(text)
    assert calls == [] and content == text
    assert len(errors) == 1 and problem in errors[0] and errors[0].startswith("tool call 1:")
    (found,) = tool_call_blocks(text)
    assert found.calls == () and found.call is None
