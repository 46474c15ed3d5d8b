"""The agent loop, token in and token out: multi-turn rollouts with tools and self-summarization.

A trajectory is built as token ids, never as text to re-tokenize:

    segment prompt   render_chat([system, user: the task], add_generation_prompt=True)
    model turn       the ids the sampler generated, as they came (trained)
    tool turn        <|user|> + encode(the tool responses) + <|end|> + <|assistant|> (not trained)

so the ids the trainer sees are exactly the ids the sampler produced and
conditioned on. Each model turn is one `RolloutClient.generate` call with the
whole segment so far as its prompt (the in-process `Engine` or any
OpenAI-compatible server); its reply goes to `ToolSet.respond`, whose
observation is tokenized once and appended. A turn cut by the token limit
gets an `<|end|>` appended (not trained). The loop stops at `finish` (or a
reply with no call), after `max_turns` model turns, or when the generated
tokens reach `max_total_tokens`.

Self-summarization: when a segment's context reaches
`summary_trigger_tokens`, the loop appends `SUMMARY_PROMPT` as a user turn
and the model writes a summary (trained). The next segment starts from the
system prompt and the task followed by `SUMMARY_HEADER` and that summary,
and this repeats up to `max_summaries` times (then the context limit ends
the trajectory, stop reason "context"). Every segment is its own training
sample and all of them receive the trajectory's final reward, so a summary
is reinforced exactly when the work it carried forward succeeded.

Counts (for the length penalty, `rewards.EffortCounts`): every generated
token is counted once, by where its first character falls in the decoded
turn: inside a `finish` call block (final message), inside any other call
block (tool call; malformed blocks too), or elsewhere (thinking: prose,
summaries and the stop token). Tool-output tokens are every appended token
that was not generated (responses, role tokens, the summary request).
`turns` counts model turns that answer the task (summaries excluded) and
`tool_calls` the calls written: each call of a list block (`data.tool_calls`)
is one, a malformed block one; these are the effort's call and turn terms.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..data.sft import render_chat
from ..data.tool_calls import tool_call_blocks
from ..inference.params import SamplingParams
from .rewards import EffortCounts
from .tools import TOOLS, ToolEvent, ToolSet, render_tool_prompt

SYSTEM_PROMPT = ("You are a coding agent working in a repository at /workspace. Use the tools to inspect "
                 "and change files and to run the tests (independent reads together, in one reply), then "
                 "call finish with a short message saying what you did.")
SUMMARY_PROMPT = ("Your context is full. Write a summary of your work so far that lets you continue: the task, "
                  "what you did, what you found, and what is left. Reply with the summary only.")
SUMMARY_HEADER = "Summary of your earlier work on this task:\n"
_CUT_NOTE = "\n[... output cut]"
STOP_REASONS = ("finish", "no_tool_call", "max_turns", "token_budget", "context")


def system_prompt(tool_names: Sequence[str] = tuple(TOOLS)) -> str:
    """The system message of every segment: the role and the tools offered."""
    return f"{SYSTEM_PROMPT}\n\n{render_tool_prompt(tool_names)}"


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Limits of one trajectory.

    max_context_tokens: one segment's length (prompt + everything appended); at most
        the engine's max_model_len.
    max_total_tokens: the token budget: generated tokens over all segments (None: only
        max_turns bounds it).
    summary_trigger_tokens: summarize when a segment's context reaches this (None: never).
    """

    max_turns: int = 8
    max_turn_tokens: int = 128
    max_context_tokens: int = 1024
    max_total_tokens: Optional[int] = None
    max_observation_tokens: int = 256
    summary_trigger_tokens: Optional[int] = None
    max_summaries: int = 2
    summary_max_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    return_routed_experts: bool = False

    def __post_init__(self):
        for name in ("max_turns", "max_turn_tokens", "max_context_tokens", "max_observation_tokens",
                     "summary_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentConfig.{name} = {getattr(self, name)} must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"the token budget {self.max_total_tokens} must be >= 1 (or None)")
        if self.max_summaries < 0:
            raise ValueError(f"max_summaries = {self.max_summaries} must be >= 0")
        trigger = self.summary_trigger_tokens
        if trigger is not None and not (trigger >= 1 and trigger + self.summary_max_tokens < self.max_context_tokens):
            raise ValueError(f"--summary-trigger-tokens {trigger} + --summary-max-tokens {self.summary_max_tokens} "
                             f"must stay below the context ({self.max_context_tokens} tokens) with room for the "
                             "summary request; lower the trigger")


@dataclasses.dataclass
class Segment:
    """One training sample of a trajectory: a prompt and everything appended to it."""

    prompt_ids: list[int]
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    trained: list[int] = dataclasses.field(default_factory=list)  # 1: generated by the model
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampler's, 0.0 on appended tokens
    policy_versions: list[int] = dataclasses.field(default_factory=list)  # -1 on appended tokens
    routed_experts: Optional[torch.Tensor] = None  # int32 [prompt + completion, layers, topk], -1 unknown
    summary: Optional[str] = None  # the summary this segment ended with

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def append(self, ids: Sequence[int], *, trained: bool, logprobs: Sequence[float] = (),
               versions: Sequence[int] = ()) -> None:
        n = len(ids)
        self.completion_ids += list(ids)
        self.trained += [int(trained)] * n
        self.logprobs += list(logprobs) if trained else [0.0] * n
        self.policy_versions += list(versions) if trained else [-1] * n

    def drop_opener(self, opener: Sequence[int]) -> int:
        """Remove a trailing `opener` (the assistant header an observation turn ends with) when it was
        appended, not generated; returns how many ids went."""
        n = len(opener)
        if n and self.completion_ids[-n:] == list(opener) and not any(self.trained[-n:]):
            for values in (self.completion_ids, self.trained, self.logprobs, self.policy_versions):
                del values[-n:]
            return n
        return 0

    def record_routes(self, routes: Optional[torch.Tensor]) -> None:
        """Merge one call's routes (rows for its prompt + generated ids): a row already known keeps
        the routing it had when its token was processed; unknown rows (-1) take the new ones."""
        if routes is None:
            return
        if self.routed_experts is None:
            self.routed_experts = routes.clone()
            return
        old, n = self.routed_experts, len(self.routed_experts)
        merged = routes.clone()
        known = (old[:, 0, 0] >= 0)[:, None, None]
        merged[:n] = torch.where(known, old, routes[:n])
        self.routed_experts = merged

    def padded_routes(self) -> Optional[torch.Tensor]:
        """Routes covering every id (rows never processed are -1)."""
        if self.routed_experts is None:
            return None
        missing = self.length - len(self.routed_experts)
        if missing <= 0:
            return self.routed_experts[:self.length]
        pad = torch.full((missing, *self.routed_experts.shape[1:]), -1, dtype=torch.int32)
        return torch.cat([self.routed_experts, pad])


@dataclasses.dataclass
class Turn:
    """One model message of a trajectory: where its generated ids lie and what came of it.

    segment: index into `Trajectory.segments`; start, end: the message's generated ids are
    `completion_ids[start:end]` of that segment (the ids before `start` end with <|assistant|>).
    """

    segment: int
    start: int
    end: int
    text: str  # decoded, stop token excluded
    kind: str = "action"  # "action" (answers the task) or "summary"
    events: list[ToolEvent] = dataclasses.field(default_factory=list)
    observation: str = ""  # the tool responses it got back
    thinking_tokens: int = 0  # generated tokens outside call blocks (stop token included)


@dataclasses.dataclass
class Trajectory:
    """One rollout of the agent on one task."""

    segments: list[Segment]
    events: list[ToolEvent]
    counts: EffortCounts
    stop_reason: str  # one of STOP_REASONS
    final_message: Optional[str]
    summaries: list[str]
    generated_tokens: int
    turns: list[Turn] = dataclasses.field(default_factory=list)
    tool_names: tuple = tuple(TOOLS)  # the tools offered

    @property
    def finished(self) -> bool:
        return self.stop_reason == "finish"


def _token_starts(tokenizer, ids: Sequence[int]) -> list[int]:
    """Character offset where each token's text starts in decode(ids)."""
    starts, previous = [], 0
    for i in range(len(ids)):
        starts.append(previous)
        previous = max(previous, len(tokenizer.decode(known_ids(tokenizer, ids[:i + 1]))))
    return starts


def known_ids(tokenizer, ids: Sequence[int]) -> list[int]:
    """`ids` without those past the tokenizer's vocabulary (a model's padded vocabulary can sample
    them; they decode to nothing)."""
    return [t for t in ids if 0 <= t < tokenizer.vocab_size]


class _Counter:
    def __init__(self):
        self.thinking = self.tool_call = self.tool_output = self.final = self.calls = self.turns = 0

    def generated(self, tokenizer, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
        """Count one model turn's ids; returns the turn's text (stop token excluded)."""
        body = list(ids[:-1]) if ids and ids[-1] in stop_ids else list(ids)
        text = tokenizer.decode(known_ids(tokenizer, body))
        blocks = tool_call_blocks(text)
        self.calls += sum(max(1, len(b.calls)) for b in blocks)
        for start in _token_starts(tokenizer, body):
            block = next((b for b in blocks if b.start <= start < b.end), None)
            if block is None:
                self.thinking += 1
            elif block.call is not None and block.call.name == "finish":
                self.final += 1
            else:
                self.tool_call += 1
        self.thinking += len(ids) - len(body)
        return text

    def effort(self) -> EffortCounts:
        return EffortCounts(thinking_tokens=self.thinking, tool_call_tokens=self.tool_call,
                            tool_output_tokens=self.tool_output, final_message_tokens=self.final,
                            tool_calls=self.calls, turns=self.turns)


class Agent:
    """Runs trajectories for one task's tools with a `RolloutClient` (see the module docstring).

    Args:
        client: anything with `generate(prompts: list[list[int]], params) -> list[Completion]`.
        tokenizer: the model's tokenizer (with chat tokens).
        config: an `AgentConfig`.
    """

    def __init__(self, client, tokenizer, config: AgentConfig = AgentConfig()):
        self.client, self.tok, self.config = client, tokenizer, config
        self.stop_ids = (tokenizer.chat["end"], tokenizer.eod)
        trigger = config.summary_trigger_tokens
        request = len(self._user_turn(SUMMARY_PROMPT, config.max_observation_tokens))
        if trigger is not None and trigger + request + config.summary_max_tokens >= config.max_context_tokens:
            raise ValueError(f"--summary-trigger-tokens {trigger} + the summary request ({request} tokens) + "
                             f"--summary-max-tokens {config.summary_max_tokens} must stay below the context "
                             f"({config.max_context_tokens} tokens); lower the trigger or the summary length")

    def segment_prompt(self, system: str, instruction: str, summary: Optional[str]) -> list[int]:
        user = instruction if summary is None else f"{instruction}\n\n{SUMMARY_HEADER}{summary}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return render_chat(messages, self.tok, add_generation_prompt=True)[0]

    def _user_turn(self, text: str, limit: int) -> list[int]:
        """<|user|> text <|end|> <|assistant|>, the text cut to `limit` tokens (a note marks the cut)."""
        body = self.tok.encode(text)
        if len(body) > limit:
            note = self.tok.encode(_CUT_NOTE)
            body = body[:max(0, limit - len(note))] + note[:limit]
        return [*self.tok.role_ids("user"), *body, self.tok.chat["end"], *self.tok.role_ids("assistant")]

    def _generate(self, ids: list[int], max_tokens: int, seed: int):
        cfg = self.config
        params = SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                seed=seed % (2 ** 63), stop_token_ids=self.stop_ids, logprobs=True,
                                return_routed_experts=cfg.return_routed_experts)
        return self.client.generate([ids], params)[0]

    def run(self, toolset: ToolSet, instruction: str, *, seed: int = 0,
            system: Optional[str] = None) -> Trajectory:
        """One trajectory on `instruction`, its tools run by `toolset`."""
        cfg, tok = self.config, self.tok
        system = system_prompt(toolset.names) if system is None else system
        segment = Segment(self.segment_prompt(system, instruction, None))
        segments, events, summaries, turns = [segment], [], [], []
        counter = _Counter()
        generated = calls = 0
        summary_request = self._user_turn(SUMMARY_PROMPT, cfg.max_observation_tokens)
        summary_reserve = len(summary_request) + cfg.summary_max_tokens
        final_message, stop = None, None

        def summaries_left() -> bool:
            return cfg.summary_trigger_tokens is not None and len(summaries) < cfg.max_summaries

        while stop is None:
            if counter.turns >= cfg.max_turns:
                stop = "max_turns"
                break
            budget = None if cfg.max_total_tokens is None else cfg.max_total_tokens - generated
            if budget is not None and budget <= 0:
                stop = "token_budget"
                break
            limit = cfg.max_context_tokens - (summary_reserve if summaries_left() else 0)
            room = limit - segment.length - 1  # one token kept to close a cut turn
            if summaries_left() and any(segment.trained) and (segment.length >= cfg.summary_trigger_tokens
                                                              or room < 1):
                # self-summarization: the request (not trained), the summary (trained), a new segment;
                # only after a model turn, so a long segment prompt cannot chain summaries. The request is
                # a user turn of its own: the assistant header the observation ended with goes first
                counter.tool_output += len(summary_request) - segment.drop_opener(tok.role_ids("assistant"))
                segment.append(summary_request, trained=False)
                max_tokens = min(cfg.summary_max_tokens, cfg.max_context_tokens - segment.length,
                                 budget if budget is not None else cfg.summary_max_tokens)
                out = self._generate(segment.ids, max_tokens, seed * 1_000_003 + calls)
                calls += 1
                segment.record_routes(out.routed_experts)
                start = len(segment.completion_ids)
                segment.append(out.token_ids, trained=True, logprobs=out.logprobs, versions=out.policy_versions)
                generated += len(out.token_ids)
                summary = counter.generated(tok, out.token_ids, self.stop_ids).strip()
                turns.append(Turn(len(segments) - 1, start, start + len(out.token_ids), summary, "summary"))
                segment.summary = summary
                summaries.append(summary)
                segment = Segment(self.segment_prompt(system, instruction, summary))
                segments.append(segment)
                continue
            if room < 1:
                stop = "context"
                break
            max_tokens = min(cfg.max_turn_tokens, room, budget if budget is not None else room)
            out = self._generate(segment.ids, max_tokens, seed * 1_000_003 + calls)
            calls += 1
            counter.turns += 1
            segment.record_routes(out.routed_experts)
            start, thinking = len(segment.completion_ids), counter.thinking
            segment.append(out.token_ids, trained=True, logprobs=out.logprobs, versions=out.policy_versions)
            generated += len(out.token_ids)
            text = counter.generated(tok, out.token_ids, self.stop_ids)
            record = Turn(len(segments) - 1, start, start + len(out.token_ids), text,
                          thinking_tokens=counter.thinking - thinking)
            turns.append(record)
            if not out.token_ids or out.token_ids[-1] not in self.stop_ids:
                segment.append([tok.chat["end"]], trained=False)  # the turn was cut: close it
                counter.tool_output += 1
                if cfg.max_total_tokens is not None and generated >= cfg.max_total_tokens:
                    stop = "token_budget"  # cut by the budget: its calls are not run
                    break
            turn = toolset.respond(text)
            events += turn.events
            record.events, record.observation = list(turn.events), turn.observation
            if turn.finished:
                final_message = turn.final_message
                stop = "finish" if any(e.name == "finish" and e.ok for e in turn.events) else "no_tool_call"
                break
            limit_now = cfg.max_context_tokens - (summary_reserve if summaries_left() else 0)
            body_room = limit_now - segment.length - 3  # <|user|> ... <|end|> <|assistant|>
            if body_room < 1:
                if summaries_left():
                    continue  # no room for the responses: summarize (the next pass) and go on
                stop = "context"
                break
            observation = self._user_turn(turn.observation, min(cfg.max_observation_tokens, body_room))
            segment.append(observation, trained=False)
            counter.tool_output += len(observation)
        return Trajectory(segments, events, counter.effort(), stop, final_message, summaries, generated, turns,
                          tuple(toolset.names))
