"""The OpenAI wire format of `server.py`: request bodies, their `SamplingParams`, response pieces.

Requests are pydantic models in strict mode (a string where a number belongs
is an error, not a conversion); unknown fields are ignored, as OpenAI's own
clients send fields a server may not know. Everything that fails becomes a
`RequestError`, which the server answers with a 400 and OpenAI's error body.

What maps to what:

    OpenAI field                      SamplingParams
    max_tokens / max_completion_tokens max_tokens (default 16 for completions; the rest of
                                       the context for chat)
    temperature, top_p, seed           the same (seed + i for the i-th of n choices)
    stop (str or list)                 stop
    logprobs: int (completions)        logprobs=True, top_logprobs=the int
    logprobs: true, top_logprobs: n    logprobs=True, top_logprobs=n
    (chat)
    extensions: top_k (-1 or 0: off), stop_token_ids, ignore_eos, return_routed_experts,
    speculative ("mtp"), num_speculative_tokens

The end-of-document id (and for chat the end-of-turn id) stop generation
unless `ignore_eos`. Logprobs are `Completion.logprobs`: the model's full
distribution at the request's temperature (temperature 1 when greedy; vLLM's
default raw logprobs are always at temperature 1), one per generated token
including a stop token, so they line up with `token_ids`.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..data.tool_calls import parse_tool_calls
from .params import SamplingParams

MAX_TOP_LOGPROBS = 20
_SEED_RANGE = (-(2**63), 2**63)
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class RequestError(ValueError):
    """A request the server cannot serve; `param` names the field (OpenAI's error `param`), `status`
    is the HTTP status (default 400; 404 for an unknown model)."""

    def __init__(self, message: str, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.param = param
        self.status = status or (404 if param == "model" else 400)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ------------------------------------------------------------------ requests
class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, description="most tokens to generate")
    temperature: float | None = Field(None, description="0 is greedy; default 1")
    top_p: float | None = None
    n: int = Field(1, description="completions per prompt")
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(None, description='{"include_usage": true} adds a usage chunk')
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: int | None = Field(None, description="extension: keep the k most likely tokens; 0 or -1 keeps all")
    stop_token_ids: list[int] | None = Field(None, description="extension: ids that end the completion")
    ignore_eos: bool = Field(False, description="extension: do not stop at the end-of-document/turn id")
    return_routed_experts: bool = Field(False, description="extension: add routed_experts to every choice")
    return_token_ids: bool | None = Field(None, description="accepted for vLLM clients; ids are always returned")
    return_tokens_as_token_ids: bool = Field(False, description='logprob tokens as "token_id:ID" (vLLM)')
    speculative: Literal["mtp"] | None = Field(None, description="extension: MTP speculative decoding")
    num_speculative_tokens: int | None = None


class CompletionRequest(_Request):
    """`POST /v1/completions`: OpenAI's legacy completions, prompts as text or token ids."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0},
        {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "n": 2, "logprobs": 2, "return_routed_experts": True},
        {"prompt": [7, 8], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
         "top_k": 5, "seed": 3, "stop_token_ids": [2], "speculative": "mtp"}]})

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, token ids, or a list of either (one choice set per prompt)")
    logprobs: int | None = Field(None, description="log-probs of the generated tokens and the n most likely")
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`, rendered with our chat template and tool-call format."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ls?"},
                      {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                          "name": "sh", "arguments": "{\"cmd\": \"ls\"}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "a.py"}],
         "max_completion_tokens": 4, "stream": True},
        {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 2, "tool_choice": "auto",
         "tools": [{"type": "function", "function": {"name": "weather"}}]}]})

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class WeightsRequest(BaseModel):
    """`POST /v1/weights` as JSON: reload from a checkpoint directory. (New weights themselves go
    as binary, `weight_sync.encode_update`'s bytes, never as JSON numbers.)"""

    model_config = ConfigDict(strict=True, extra="ignore")

    path: str = Field(description="a megatron-composer checkpoint root or iter_XXXXXXX dir")
    version: int | None = Field(None, description="the new weights version (default: current + 1)")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors of one request body."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({reason}); send a JSON object", None
    if not loc:
        return f"the request body is not a JSON object ({first.get('msg')}); send a JSON object", None
    union = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    param = loc[0]
    where = ".".join(loc[:1] + [p for p in loc[1:] if not p.startswith(("list[", "str", "int"))])
    got = f" (got {first['input']!r:.80})" if "input" in first and first.get("type") != "missing" else ""
    if param == "prompt" and len(union) > 1:
        return f"prompt must be a string, a list of strings, a list of token ids or a list of token-id lists{got}", param
    return f"{where}: {first.get('msg')}{got}", param


# ------------------------------------------------------------------ sampling
def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if value is not None and (value < low or (high is not None and value > high)):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name}={value}; use an integer {bound}", name)


def sampling_params(req: _Request, *, max_tokens: int | None, top_logprobs: int | None,
                    stop_ids: tuple[int, ...]) -> SamplingParams:
    """The SamplingParams of a request (choice 0). `max_tokens`: the resolved default; `stop_ids`:
    the tokenizer's end ids that stop unless `ignore_eos`."""
    _check_int("n", req.n, 1)
    _check_int("max_tokens", max_tokens, 1)
    _check_int("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    if req.seed is not None and not _SEED_RANGE[0] <= req.seed < _SEED_RANGE[1] - req.n:
        raise RequestError(f"seed={req.seed}; use a 64-bit signed integer", "seed")
    top_k = req.top_k
    if top_k == -1:
        top_k = 0  # vLLM's "off"
    stop_token_ids = tuple(req.stop_token_ids or ()) + (() if req.ignore_eos else stop_ids)
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if top_k is None else top_k,
            seed=req.seed, stop_token_ids=stop_token_ids, stop=req.stop or (),
            logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0,
            return_routed_experts=req.return_routed_experts, speculative=req.speculative,
            num_speculative_tokens=req.num_speculative_tokens)
    except ValueError as exc:
        field = str(exc).split("=", 1)[0]
        raise RequestError(str(exc), field if field.isidentifier() else None) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: with a seed, choice i draws with seed + i (so the n choices
    differ and each is reproducible)."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


# ------------------------------------------------------------------ text
def decode(tokenizer, ids) -> str:
    """Text of `ids`; ids past the tokenizer's pieces (a model vocabulary padded beyond the
    tokenizer) have none."""
    return tokenizer.decode([t for t in ids if t < tokenizer.vocab_size])


class TextStream:
    """The text of a growing completion, in pieces that never need taking back.

    Cut at the first stop string (OpenAI leaves it out of the text); a final
    stop id (end of turn, a `stop_token_ids` entry) is left out too, though
    it stays in `token_ids`. While unfinished, a tail that could still become
    a stop string, and an incomplete UTF-8 character, are held back.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], stop_ids: tuple[int, ...]):
        self.tokenizer, self.stop, self.stop_ids = tokenizer, stop, set(stop_ids)
        self.sent = ""

    def full_text(self, ids: list[int], finish_reason: str | None) -> str:
        if self.tokenizer is None:
            return ""
        if finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = decode(self.tokenizer, ids)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[:min(cuts)] if cuts else text

    def _safe_length(self, text: str) -> int:
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:k]):
                    end -= k
                    break
        return end

    def delta(self, ids: list[int], finish_reason: str | None) -> str:
        """The new text since the last call (all of the rest once `finish_reason` is set)."""
        text = self.full_text(ids, finish_reason)
        if finish_reason is None:
            text = text[:self._safe_length(text)]
        if not text.startswith(self.sent):
            return ""  # a re-decoded prefix changed (byte fallback); wait for it to settle
        new, self.sent = text[len(self.sent):], text
        return new


def token_text(tokenizer, token: int, as_ids: bool) -> tuple[str, list[int]]:
    """(the token as logprobs show it, its UTF-8 bytes): a byte-fallback piece is its one byte.
    `text_offset` counts these strings, so it matches the text except after a \\xNN byte."""
    if as_ids or tokenizer is None or token >= tokenizer.vocab_size:
        text = f"token_id:{token}"
        return text, list(text.encode())
    match = _BYTE_PIECE.match(tokenizer.id_to_piece(token))
    if match:  # ASCII is its character; a byte of a longer UTF-8 sequence shows as \xNN
        byte = int(match.group(1), 16)
        return (chr(byte) if byte < 0x80 else f"\\x{byte:02x}"), [byte]
    text = tokenizer.decode([token])
    return text, list(text.encode("utf-8"))


def completion_logprobs(tokenizer, token_ids, logprobs, top, as_ids: bool, offset: int = 0) -> dict:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs ({token: logprob} per
    position) and text_offset (characters of the token strings before each, from `offset`)."""
    tokens, offsets = [], []
    for token in token_ids:
        offsets.append(offset)
        text, _ = token_text(tokenizer, token, as_ids)
        tokens.append(text)
        offset += len(text)
    tops = [{token_text(tokenizer, t, as_ids)[0]: lp for t, lp in row} for row in top] if top else None
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids, logprobs, top, as_ids: bool) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs)):
        text, raw = token_text(tokenizer, token, as_ids)
        alternatives = []
        for t, alt_lp in (top[i] if top else ()):
            alt_text, alt_raw = token_text(tokenizer, t, as_ids)
            alternatives.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content}


def choice_extensions(completion, with_experts: bool) -> dict:
    """The extension fields every choice carries (see the module docstring of `server.py`)."""
    fields = {"token_ids": list(completion.token_ids), "prompt_token_ids": list(completion.prompt_token_ids),
              "policy_versions": list(completion.policy_versions)}
    if completion.sampling_logprobs:
        fields["sampling_logprobs"] = list(completion.sampling_logprobs)
    if with_experts:
        experts = completion.routed_experts
        fields["routed_experts"] = None if experts is None else experts.tolist()
    return fields


def tool_calls_json(calls) -> list[dict]:
    """OpenAI `tool_calls` of parsed `ToolCall`s: id, type "function", arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in calls]


def chat_message(text: str, with_tools: bool) -> tuple[dict, bool]:
    """(the assistant message of a reply, whether it calls tools). With tools the
    `<tool_call>` blocks become OpenAI `tool_calls` and leave the content (None
    when nothing else is left); a malformed block stays in the content."""
    calls = []
    if with_tools:
        text, calls, _ = parse_tool_calls(text)
    message = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = tool_calls_json(calls)
    return message, bool(calls)
