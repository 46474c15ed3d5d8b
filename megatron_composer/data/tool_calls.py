"""Tool calls in chat: the one text format the model writes and reads.

The server (`inference/server.py`) and the agentic RL environment share this
module, so a model trained on rollouts calls tools the same way it does when
served. The format, on top of `data.sft.render_chat`'s roles:

1. The tools a request offers (OpenAI's ``tools``: JSON-schema functions) are
   listed in the system message by `render_tools`: a short instruction and one
   JSON object per function between ``<tools>`` and ``</tools>``.
2. The assistant calls a tool by writing, anywhere in its reply::

       <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

   The JSON is parsed strictly (`json.loads` rules, no NaN/Infinity): an
   object with exactly a string ``"name"`` and an object ``"arguments"``.
   Several calls in one reply are several blocks, or one block holding a JSON
   list of call objects (`format_tool_calls`)::

       <tool_call>[{"name": "read_file", "arguments": {"path": "a.py"}},
                   {"name": "read_file", "arguments": {"path": "b.py"}}]</tool_call>

   A list holds 1 to `MAX_CALLS_PER_MESSAGE` call objects, never lists; a
   list with any bad entry is one malformed block and none of its calls is
   taken. What runs them decides the order (`rl.tools.ToolSet.respond`:
   consecutive reads at once, everything else one by one, in order).
3. Each result comes back as a user turn whose content is
   ``<tool_response name="get_weather">...</tool_response>`` (one block per
   result; consecutive results share one turn).

Kimi K2.5's own tool-call tokens are read as calls too, so the published
model's native habit is understood before RL teaches it ours::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

is the call ``get_weather({"city": "Paris"})`` (the ``functions.`` prefix and
the ``:index`` suffix of Kimi's call id are dropped; the section markers are
removed from the content). `format_kimi_tool_call` writes one.

`parse_tool_calls` never raises on model output: a malformed block stays in
the text and is reported in ``errors``, worded so an environment can hand it
back to the model. `messages_for_template` turns OpenAI chat messages
(assistant ``tool_calls``, ``role: "tool"``) into the system/user/assistant
messages `render_chat` takes.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
KIMI_SECTION_OPEN = "<|tool_calls_section_begin|>"
KIMI_SECTION_CLOSE = "<|tool_calls_section_end|>"
KIMI_CALL_OPEN = "<|tool_call_begin|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
KIMI_CALL_CLOSE = "<|tool_call_end|>"
_KIMI_CALL_ID = re.compile(r"^\s*(?:functions\.)?([A-Za-z0-9_.-]{1,64}?)(?::\d+)?\s*$")
TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EXAMPLE_CALL = '<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>'
MAX_CALLS_PER_MESSAGE = 8  # calls one reply may make (a longer list is malformed)
_WHITESPACE = re.compile(r"\s*")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


class ToolFormatError(ValueError):
    """Tools, messages or a call that do not fit the format; the message names the value and the fix."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function name and its arguments (a JSON object)."""

    name: str
    arguments: dict


def format_tool_call(name: str, arguments: dict) -> str:
    """The text block that calls `name` with `arguments` (what the model should write).

    Raises ToolFormatError (a ValueError) for a non-string name, non-dict
    arguments, or arguments that are not JSON (NaN, sets, ...).
    """
    if not isinstance(name, str) or not name:
        raise ToolFormatError(f"tool name {name!r} must be a non-empty string")
    if not isinstance(arguments, dict):
        raise ToolFormatError(f"arguments for tool {name!r} must be a dict (a JSON object), got {type(arguments).__name__}")
    try:
        payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ToolFormatError(f"arguments for tool {name!r} are not JSON-serializable: {exc}") from None
    return f"{CALL_OPEN}{payload}{CALL_CLOSE}"


def format_tool_calls(calls: Sequence[tuple[str, dict]]) -> str:
    """One block calling every (name, arguments) of `calls` as a JSON list, in order.

    Raises ToolFormatError for an empty list, more than MAX_CALLS_PER_MESSAGE
    calls, or a call `format_tool_call` refuses.
    """
    if not 1 <= len(calls) <= MAX_CALLS_PER_MESSAGE:
        raise ToolFormatError(f"a call list holds 1 to {MAX_CALLS_PER_MESSAGE} calls, got {len(calls)}; "
                              "split it over several replies")
    payloads = [format_tool_call(name, arguments)[len(CALL_OPEN):-len(CALL_CLOSE)] for name, arguments in calls]
    return f"{CALL_OPEN}[{', '.join(payloads)}]{CALL_CLOSE}"


def _check_list(value: list) -> str | None:
    """What is wrong with a decoded list of calls, or None."""
    if not value:
        return "the call list is empty; give at least one call object"
    if len(value) > MAX_CALLS_PER_MESSAGE:
        return (f"the call list has {len(value)} calls, more than {MAX_CALLS_PER_MESSAGE}; "
                "split it over several replies")
    for i, entry in enumerate(value, 1):
        if isinstance(entry, list):
            return f"entry {i} of the call list is a list; lists of calls do not nest"
        problem = _check_call(entry)
        if problem is not None:
            return f"entry {i} of the call list: {problem}"
    return None


def _check_call(value: Any) -> str | None:
    """What is wrong with a decoded call object, or None."""
    if not isinstance(value, dict):
        return f"the call is a JSON {type(value).__name__}, not an object"
    if set(value) != {"name", "arguments"}:
        return f'the call has keys {sorted(value)}; it needs exactly "name" and "arguments"'
    if not isinstance(value["name"], str) or not value["name"]:
        return f'"name" is {value["name"]!r}; it must be a non-empty string'
    if not isinstance(value["arguments"], dict):
        return f'"arguments" is a JSON {type(value["arguments"]).__name__}; it must be an object'
    return None


def _decode_block(text: str, start: int) -> tuple[Any, int, str | None]:
    """Read the block whose opening tag ends at `start`: (value, index after the block, problem).

    The decoder reads exactly one JSON value, so a closing tag inside a JSON
    string (code that mentions ``</tool_call>``) does not end the block. When
    the JSON or the closing tag is wrong, the block runs to the next closing
    tag (or the end of the text) and `problem` says what is wrong.
    """
    try:
        value, end = _DECODER.raw_decode(text, _WHITESPACE.match(text, start).end())
        end = _WHITESPACE.match(text, end).end()
        if text.startswith(CALL_CLOSE, end):
            problem = _check_list(value) if isinstance(value, list) else _check_call(value)
            return value, end + len(CALL_CLOSE), problem
        problem = f"text follows the JSON object before {CALL_CLOSE}"
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting recurses
        problem = f"not valid JSON ({exc})"
    close = text.find(CALL_CLOSE, start)
    if close < 0:
        return None, len(text), f"no {CALL_CLOSE} closes the block"
    return None, close + len(CALL_CLOSE), problem


def format_kimi_tool_call(name: str, arguments: dict, index: int = 0) -> str:
    """Kimi K2.5's native spelling of one call (its id `functions.NAME:INDEX`), without the
    section markers that enclose a reply's calls."""
    format_tool_call(name, arguments)  # the same checks
    payload = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    return f"{KIMI_CALL_OPEN}functions.{name}:{index}{KIMI_ARGUMENTS}{payload}{KIMI_CALL_CLOSE}"


def _decode_kimi_block(text: str, start: int) -> tuple[Any, int, str | None]:
    """A Kimi-native call whose opening token ends at `start`, as `_decode_block` returns it."""
    close = text.find(KIMI_CALL_CLOSE, start)
    end = len(text) if close < 0 else close + len(KIMI_CALL_CLOSE)
    if close < 0:
        return None, end, f"no {KIMI_CALL_CLOSE} closes the call"
    head, sep, arguments = text[start:close].partition(KIMI_ARGUMENTS)
    match = _KIMI_CALL_ID.match(head)
    if not sep or not match:
        return None, end, f"the call id {head!r} is not functions.NAME:INDEX followed by {KIMI_ARGUMENTS}"
    try:
        value = _DECODER.decode(arguments.strip())
    except (ValueError, RecursionError) as exc:
        return None, end, f"the arguments are not valid JSON ({exc})"
    call = {"name": match.group(1), "arguments": value}
    return call, end, _check_call(call)


@dataclasses.dataclass(frozen=True)
class CallBlock:
    """Where one ``<tool_call>`` block lies in a text: ``text[start:end]``; its `calls` (one for a
    call object, several for a list; none when malformed) or its `problem`."""

    start: int
    end: int
    calls: tuple[ToolCall, ...]
    problem: str | None
    is_list: bool = False

    @property
    def call(self) -> ToolCall | None:
        """The call of a well-formed single-call block (not a list); None otherwise."""
        return self.calls[0] if self.problem is None and not self.is_list else None


def tool_call_blocks(text: str) -> list[CallBlock]:
    """Every ``<tool_call>`` block of `text`, well-formed or not, in order (never raises).

    A malformed block runs to the next closing tag (or the end of the text);
    its `problem` says what is wrong, with the fix. The agent environment uses
    the spans to count which generated tokens are calls.
    """
    blocks: list[CallBlock] = []
    position = 0
    while True:
        ours, kimi = text.find(CALL_OPEN, position), text.find(KIMI_CALL_OPEN, position)
        if ours < 0 and kimi < 0:
            return blocks
        if kimi < 0 or 0 <= ours < kimi:
            start = ours
            value, end, problem = _decode_block(text, start + len(CALL_OPEN))
        else:
            start = kimi
            value, end, problem = _decode_kimi_block(text, start + len(KIMI_CALL_OPEN))
        is_list = isinstance(value, list)
        calls = () if problem is not None else tuple(
            ToolCall(v["name"], v["arguments"]) for v in (value if is_list else [value]))
        blocks.append(CallBlock(start, end, calls, problem, is_list))
        position = end


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """Split model output into its text and its tool calls.

    Returns:
        (content, calls, errors): `content` is `text` without the well-formed
        call blocks (stripped of surrounding whitespace); `calls` the parsed
        calls in order; `errors` one message per malformed block (which is
        left in `content`), e.g. ``tool call 2: "arguments" is a JSON list; it
        must be an object; write <tool_call>{"name": ...}</tool_call>``.
    """
    kept: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    position = 0
    for number, block in enumerate(tool_call_blocks(text), start=1):
        kept.append(text[position:block.start])
        if block.problem is None:
            calls.extend(block.calls)
        else:
            errors.append(f"tool call {number}: {block.problem}; write {_EXAMPLE_CALL}")
            kept.append(text[block.start:block.end])
        position = block.end
    kept.append(text[position:])
    content = "".join(kept)
    if calls and KIMI_SECTION_OPEN in content:
        content = content.replace(KIMI_SECTION_OPEN, "").replace(KIMI_SECTION_CLOSE, "")
    return content.strip(), calls, errors


def render_tool_response(name: str, content: str) -> str:
    """The user-turn text that hands a tool's result back to the model."""
    return f"<tool_response name={json.dumps(str(name), ensure_ascii=False)}>{content}</tool_response>"


def _function_of(tool: Any, index: int) -> dict:
    """The function description of one OpenAI `tools` entry, checked."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ToolFormatError(f'{where} is a {type(tool).__name__}; write {{"type": "function", "function": {{"name": ...}}}}')
    if tool.get("type", "function") != "function":
        raise ToolFormatError(f'{where} has type {tool.get("type")!r}; only "function" tools are supported')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolFormatError(f'{where} has no "function" object; write {{"type": "function", "function": {{"name": ...}}}}')
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
        raise ToolFormatError(f"{where}.function.name {name!r} must match {TOOL_NAME_PATTERN.pattern}")
    description = function.get("description", "")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(description, str):
        raise ToolFormatError(f"{where}.function.description must be a string, got {type(description).__name__}")
    if not isinstance(parameters, dict):
        raise ToolFormatError(f"{where}.function.parameters must be a JSON schema object, got {type(parameters).__name__}")
    return {"name": name, "description": description, "parameters": parameters}


def render_tools(tools: Sequence[dict]) -> str:
    """The system-message block that lists `tools` (OpenAI format) and explains the call format.

    Raises ToolFormatError (a ValueError) naming the first malformed entry.
    """
    functions = [_function_of(tool, i) for i, tool in enumerate(tools)]
    lines = "\n".join(json.dumps(f, ensure_ascii=False, sort_keys=True) for f in functions)
    return (
        "# Tools\n\n"
        "You can call the functions listed below. To call one, write\n"
        f"{_EXAMPLE_CALL}\n"
        "with the arguments as a JSON object that follows the function's parameters schema. "
        "Write one block per call, or several calls at once as a JSON list in one block "
        f"(at most {MAX_CALLS_PER_MESSAGE}). Each result comes back in a user message as "
        '<tool_response name="NAME">...</tool_response>, in the order of the calls.\n\n'
        f"<tools>\n{lines}\n</tools>"
    )


def _text_content(message: dict, where: str) -> str:
    """OpenAI content (a string, a list of text parts, or null) as one string."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ToolFormatError(f'{where}.content[{j}] must be {{"type": "text", "text": "..."}}; '
                                 "only text content is supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ToolFormatError(f"{where}.content is a {type(content).__name__}; give a string or a list of text parts")


def _assistant_text(message: dict, where: str, names_by_id: dict) -> str:
    text = _text_content(message, where)
    blocks = []
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolFormatError(f'{where}.tool_calls[{j}] must be {{"id": ..., "type": "function", '
                             '"function": {"name": ..., "arguments": "{...}"}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise ToolFormatError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON ({exc}); "
                                 'send a JSON object as a string, e.g. "{\\"city\\": \\"Paris\\"}"') from None
        blocks.append(format_tool_call(function["name"], arguments))
        if isinstance(call.get("id"), str):
            names_by_id[call["id"]] = function["name"]
    return "\n".join([text, *blocks]) if text else "\n".join(blocks)


def messages_for_template(openai_messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[dict]:
    """OpenAI chat messages (and `tools`) as the system/user/assistant messages `render_chat` takes.

    - ``system`` and ``developer`` messages become system messages; with
      `tools`, `render_tools` is appended to the first system message (or
      becomes one at the start);
    - assistant ``tool_calls`` become `format_tool_call` blocks after the
      content;
    - ``tool`` messages become `render_tool_response` blocks in a user turn
      (consecutive ones share one turn); the tool name comes from the
      assistant call with the same ``tool_call_id``, else the message's
      ``name``.

    Raises ToolFormatError (a ValueError) naming the first bad message and the fix.
    """
    result: list[dict] = []
    names_by_id: dict[str, str] = {}
    pending_responses: list[str] = []

    def flush_responses():
        if pending_responses:
            result.append({"role": "user", "content": "\n".join(pending_responses)})
            pending_responses.clear()

    for i, message in enumerate(openai_messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ToolFormatError(f'{where} is a {type(message).__name__}; write {{"role": ..., "content": ...}}')
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            name = names_by_id.get(call_id) or message.get("name")
            if not isinstance(name, str):
                raise ToolFormatError(f"{where} is a tool result with tool_call_id {call_id!r} that no earlier "
                                 'assistant tool call has; give the id of the call, or a "name"')
            pending_responses.append(render_tool_response(name, _text_content(message, where)))
            continue
        flush_responses()
        if role in ("system", "developer"):
            result.append({"role": "system", "content": _text_content(message, where)})
        elif role == "user":
            result.append({"role": "user", "content": _text_content(message, where)})
        elif role == "assistant":
            result.append({"role": "assistant", "content": _assistant_text(message, where, names_by_id)})
        else:
            raise ToolFormatError(f"{where} has role {role!r}; use system, developer, user, assistant or tool")
    flush_responses()
    if tools:
        block = render_tools(tools)
        if result and result[0]["role"] == "system":
            first = result[0]["content"]
            result[0] = {"role": "system", "content": f"{first}\n\n{block}" if first else block}
        else:
            result.insert(0, {"role": "system", "content": block})
    return result
