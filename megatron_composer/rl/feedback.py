"""Targeted textual feedback: hints on the model messages that went wrong (Composer 2.5).

An RL trajectory earns one reward at its end, which says little about which
of its turns was the mistake. Feedback adds a dense, local signal:

1. hint rules read a finished `agent.Trajectory` and return, for the model
   messages they object to, `(turn_index, hint_text)` (`FEEDBACK_RULES`,
   selected with `--feedback-rules`; `register_rule` or a `module:function`
   spec adds a rule of your own; the optional `JudgeRule` asks a model);
2. `attach_hints` puts them on the training samples as `Hint`s: the target
   message's place in its segment and the note's token ids;
3. the teacher context is the sample's ids with the note inserted just
   before the target message: `<|user|> hint <|end|>` (or `<|system|>`,
   `--feedback-hint-role`) before the `<|assistant|>` that opens it, so the
   message's own tokens follow unchanged (`teacher_context`);
4. `feedback_loss` distills the policy under the teacher context (no
   gradient) into the policy under the original one, on the target
   message's tokens only, beside the RL objective.

Notes are inserted as a user turn by default: the environment's tool
responses arrive as user turns, so a note there reads like one more message
from the environment, the place a model expects to be told about its calls.

The rules (each fires at most once per message):

    unknown_tool          a call to a tool that is not offered -> the tools offered
    malformed_call        a block that is not the call JSON, or arguments that do not
                          fit the tool -> the expected format / the tool's signature
    failing_test          the last edit before a run_tests that fails -> the failing assertion
    unfinished_todo       finish with open to-do items -> the open items
    thinking_in_comments  an edit whose code comments read like reasoning -> keep them out
    long_thought          more than LONG_THOUGHT_TOKENS tokens of prose before acting -> be brief
"""
from __future__ import annotations

import importlib
import re
from typing import Callable, Optional, Sequence

from ..data.tool_calls import format_tool_call
from .agent import Trajectory
from .agentic_rewards import thinking_comments
from .batches import Hint
from .tools import TOOLS

Rule = Callable[[Trajectory], list]  # trajectory -> [(turn_index, hint_text), ...]
FEEDBACK_RULES: dict[str, Rule] = {}
HINT_ROLES = ("user", "system")
LONG_THOUGHT_TOKENS = 64
_EDITS = ("write_file", "edit_file")
_TAGS = re.compile(r"</?tool_response[^>]*>")  # a report read back from an observation
_COUNTS = re.compile(r"(\d+) passed, (\d+) failed, (\d+) errors of (\d+) tests")


def register_rule(name: str):
    """Decorator: `fn(trajectory) -> [(turn_index, hint_text), ...]` becomes the rule `name`."""
    def add(fn: Rule) -> Rule:
        FEEDBACK_RULES[name] = fn
        return fn
    return add


def _action_turns(trajectory: Trajectory):
    return [(i, t) for i, t in enumerate(trajectory.turns) if t.kind == "action"]


def unknown_tool_hint(names: Sequence[str], tool_names: Sequence[str]) -> str:
    """The hint of `unknown_tool` for calls to `names` when `tool_names` are offered."""
    called = " or ".join(repr(n) for n in sorted(set(names)))
    return f"There is no tool named {called}. The tools are: {', '.join(tool_names)}."


@register_rule("unknown_tool")
def unknown_tool(trajectory: Trajectory) -> list:
    hints = []
    for i, turn in _action_turns(trajectory):
        names = [str(e.name) for e in turn.events if e.misuse == "unknown_tool"]
        if names:
            hints.append((i, unknown_tool_hint(names, trajectory.tool_names)))
    return hints


def _signature(name: str) -> str:
    spec = TOOLS[name]
    return f"{name}({', '.join(k + ('' if p.required else '?') for k, p in spec.params.items())})"


@register_rule("malformed_call")
def malformed_call(trajectory: Trajectory) -> list:
    hints = []
    example = format_tool_call("read_file", {"path": "main.py"})
    for i, turn in _action_turns(trajectory):
        parts = []
        if any(e.misuse == "malformed" for e in turn.events):
            parts.append(f'Write each call as <tool_call>{{"name": NAME, "arguments": {{...}}}}</tool_call> '
                         f"with valid JSON, for example {example}")
        for name in sorted({e.name for e in turn.events if e.misuse == "bad_arguments" and e.name in TOOLS}):
            parts.append(f"{name} takes the arguments {_signature(name)}.")
        if parts:
            hints.append((i, " ".join(parts)))
    return hints


def failing_assertion(report: str) -> Optional[str]:
    """The first failure line of a `run_tests` report (pytest's "E ..." lines, else an assert or
    error line), or None when the report shows no failure."""
    counts = _COUNTS.search(report)
    if counts is None or (int(counts.group(2)) + int(counts.group(3))) == 0:
        return None
    lines = [_TAGS.sub("", line).strip() for line in report.splitlines()]
    picked = next((line[1:].strip() for line in lines if line.startswith("E ") and line[1:].strip()), None)
    picked = picked or next((line for line in lines if "assert" in line or "Error" in line), None)
    return (picked or counts.group(0))[:200]


@register_rule("failing_test")
def failing_test(trajectory: Trajectory) -> list:
    hints, last_edit = [], None
    for i, turn in _action_turns(trajectory):
        for event in turn.events:
            if event.ok and event.name in _EDITS:
                last_edit = i
            elif event.ok and event.name == "run_tests" and last_edit is not None:
                failure = failing_assertion(turn.observation)
                if failure is not None:
                    hints.append((last_edit, f"After this edit the tests fail: {failure}"))
                last_edit = None
    return hints


@register_rule("unfinished_todo")
def unfinished_todo(trajectory: Trajectory) -> list:
    hints = []
    for i, turn in _action_turns(trajectory):
        for event in turn.events:
            if event.misuse == "unfinished_todo":
                hints.append((i, f"Do not finish yet: {event.error}. Finish them and mark them done first."))
                break
    return hints


@register_rule("thinking_in_comments")
def thinking_in_comments(trajectory: Trajectory) -> list:
    hints = []
    for i, turn in _action_turns(trajectory):
        found = []
        for event in turn.events:
            if event.ok and event.name in _EDITS and str(event.arguments.get("path", "")).endswith(".py"):
                code = event.arguments.get("content", event.arguments.get("replace", ""))
                found += [c for _, c in thinking_comments(code, set(range(1, code.count("\n") + 2)))]
        if found:
            hints.append((i, f"Keep your reasoning out of code comments (you wrote {found[0][:60]!r}); "
                             "comments say what the code does."))
    return hints


@register_rule("long_thought")
def long_thought(trajectory: Trajectory, max_tokens: int = LONG_THOUGHT_TOKENS) -> list:
    return [(i, f"Be brief: you wrote {turn.thinking_tokens} tokens before acting. Think in a sentence or "
                "two, then call a tool.")
            for i, turn in _action_turns(trajectory) if turn.thinking_tokens > max_tokens]


class JudgeRule:
    """A rule whose hints a model writes (off by default: `--feedback-rules judge`).

    For every action turn with a failed or misused call, the judge gets the
    agent's message and the environment's answer and writes one short hint
    (greedy, at most `max_tokens`). `client` is any `RolloutClient`: the
    policy's own engine, or a server given by `--feedback-judge-url`.
    """

    PROMPT = ("You review one step of a coding agent. The agent wrote:\n{message}\n\nThe environment "
              "answered:\n{answer}\n\nWrite one short sentence telling the agent what to do instead.")

    def __init__(self, client, tokenizer, max_tokens: int = 48):
        self.client, self.tok, self.max_tokens = client, tokenizer, max_tokens

    def __call__(self, trajectory: Trajectory) -> list:
        from ..data.sft import render_chat
        from ..inference.params import SamplingParams

        targets = [(i, t) for i, t in _action_turns(trajectory) if any(e.misuse or not e.ok for e in t.events)]
        if not targets:
            return []
        prompts = [render_chat([{"role": "user", "content": self.PROMPT.format(
            message=t.text[-600:], answer=t.observation[-600:] or "(nothing)")}], self.tok,
            add_generation_prompt=True)[0] for _, t in targets]
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                stop_token_ids=(self.tok.chat["end"], self.tok.eod))
        hints = []
        for (i, _), out in zip(targets, self.client.generate(prompts, params)):
            ids = [t for t in out.token_ids if 0 <= t < self.tok.vocab_size and t not in params.stop_token_ids]
            text = self.tok.decode(ids).strip()
            if text:
                hints.append((i, text))
        return hints


def resolve_rules(spec: str, *, judge_client=None, tokenizer=None,
                  long_thought_tokens: int = LONG_THOUGHT_TOKENS) -> dict[str, Rule]:
    """{name: rule} for a comma list of registered names, `package.module:function` specs and
    "judge" (needs `judge_client` and `tokenizer`)."""
    rules: dict[str, Rule] = {}
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name == "judge":
            if judge_client is None or tokenizer is None:
                raise ValueError("--feedback-rules judge needs a model to write the hints; give "
                                 "--feedback-judge-url or run where the policy's engine can judge")
            rules[name] = JudgeRule(judge_client, tokenizer)
        elif name == "long_thought":
            rules[name] = lambda traj, n=long_thought_tokens: long_thought(traj, n)
        elif name in FEEDBACK_RULES:
            rules[name] = FEEDBACK_RULES[name]
        elif ":" in name:
            module, _, attr = name.partition(":")
            try:
                rules[name] = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"--feedback-rules {name!r}: cannot import it ({exc}); give "
                                 "package.module:function of a rule") from None
        else:
            raise ValueError(f"--feedback-rules: unknown rule {name!r}; use a comma list of "
                             f"{', '.join([*FEEDBACK_RULES, 'judge'])} or package.module:function")
    return rules


def fire_rules(rules: dict[str, Rule], trajectory: Trajectory) -> dict[int, list[tuple[str, str]]]:
    """{turn index: [(rule, hint), ...]} of every rule on `trajectory`."""
    fired: dict[int, list] = {}
    for name, rule in rules.items():
        for item in rule(trajectory):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str)
                    and isinstance(item[0], int) and 0 <= item[0] < len(trajectory.turns)):
                raise ValueError(f"feedback rule {name!r} returned {item!r}; a rule returns (turn index in "
                                 f"0..{len(trajectory.turns) - 1}, hint text) pairs")
            fired.setdefault(item[0], []).append((name, item[1]))
    return fired


def note_ids(tokenizer, text: str, role: str = "user") -> list[int]:
    """The inserted note: <|role|> text <|end|> (one chat message, as `render_chat` writes it)."""
    if role not in HINT_ROLES:
        raise ValueError(f"--feedback-hint-role {role!r}; use one of {', '.join(HINT_ROLES)}")
    return [*tokenizer.role_ids(role), *tokenizer.encode(text), tokenizer.chat["end"]]


def attach_hints(trajectory: Trajectory, samples: Sequence, rules: dict[str, Rule], tokenizer,
                 role: str = "user") -> None:
    """Fire `rules` on `trajectory` and put each hinted message's `Hint` on the sample of its
    segment (`samples[k]` is segment k). Hints on one message are joined into one note."""
    for index, fired in sorted(fire_rules(rules, trajectory).items()):
        turn = trajectory.turns[index]
        if turn.end <= turn.start:
            continue  # an empty message has no tokens to distill
        sample = samples[turn.segment]
        opener = tokenizer.role_ids("assistant")
        at = len(sample.prompt_ids) + turn.start
        if (sample.prompt_ids + sample.completion_ids)[at - len(opener):at] != opener:
            raise RuntimeError(f"internal: turn {index} does not follow an <|assistant|> opening")
        text = "\n".join(hint for _, hint in fired)
        sample.hints.append(Hint(tuple(name for name, _ in fired), text, turn.start, turn.end,
                                 note_ids(tokenizer, text, role), len(opener)))


def teacher_context(sample, hint: Hint) -> tuple[list[int], int]:
    """(the teacher's ids, where the target message's first predicting position moved to).

    The ids are the sample's up to the end of the target message with the note
    inserted before the <|assistant|> that opens it; student position
    P + start - 1 + j (P: prompt length) and teacher position returned + j
    predict the same token, message token j, for j < end - start.
    """
    ids = sample.prompt_ids + sample.completion_ids
    at = len(sample.prompt_ids) + hint.start - 1
    before = at + 1 - hint.opener  # where the assistant's opening starts
    teacher = ids[:before] + list(hint.note_ids) + ids[before:len(sample.prompt_ids) + hint.end]
    return teacher, at + len(hint.note_ids)


def feedback_metrics(samples: Sequence, trajectories: int, rules: Sequence[str], turns: float) -> dict:
    """Hints per step by rule, and each rule's rate per trajectory (the targeted mistake's frequency);
    `turns`: the model turns of the step."""
    counts = dict.fromkeys(rules, 0)
    for s in samples:
        for hint in s.hints:
            for name in hint.rules:
                counts[name] = counts.get(name, 0) + 1
    out = {"feedback hints": float(sum(len(s.hints) for s in samples)),
           "feedback hinted turns per turn": sum(len(s.hints) for s in samples) / max(turns, 1.0)}
    for name, n in counts.items():
        out[f"feedback hints {name}"] = float(n)
        out[f"feedback {name} per trajectory"] = n / max(trajectories, 1)
    return out


def build_rules(rl, *, client=None, tokenizer=None) -> dict[str, Rule]:
    """The rules of an `RLConfig` (`--feedback-rules`); the judge writes with a server given by
    `--feedback-judge-url`, else with `client` (the policy's engine or inference worker)."""
    if not rl.feedback.rules:
        return {}
    judge = client
    if rl.feedback.judge_url and "judge" in [n.strip() for n in rl.feedback.rules.split(",")]:
        from ..inference.client import HTTPRolloutClient

        judge = HTTPRolloutClient(rl.feedback.judge_url)
    return resolve_rules(rl.feedback.rules, judge_client=judge, tokenizer=tokenizer,
                         long_thought_tokens=rl.feedback.long_thought_tokens)
