"""Rewards: the concave length penalty, effort, and the registry of weighted reward terms.

A sample's reward is a weighted sum of named terms, `--reward
correctness=1.0,length=0.001,...`; every term's value is kept per sample so
the loop can log each one. Built-in terms:

    correctness   sample.correctness (a float, e.g. the fraction of tests that pass)
    all_pass      sample.all_pass (1.0 when every test passes)
    style         sample.style (-(style issues the model added), 0 is clean; `agentic_rewards`)
    communication sample.communication (1.0 for a final message of sensible length)
    tool_misuse   sample.tool_misuse (-(misused tool calls), 0 is clean)
    parallel_tool_calls sample.parallel_tool_calls (share of reads batched in one message)
    tool_efficiency sample.tool_efficiency (-(redundant tool calls), 0 is clean)
    length        -length_penalty(effort(sample.effort_counts, w), k, q)

The length penalty is the recipe's concave, increasing
C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)) of the effort x, a weighted sum
of thinking, tool-call, tool-output and final-message tokens, tool calls and
turns. C(0) = 0, C'(0) = 1, q = 0 gives x, q -> 1 gives ln(1 + k x) / k and
q > 1 is bounded by 1 / (k (q - 1)): small efforts cost about linearly,
long ones ever less per unit. The recipe publishes neither k, q nor the
weights; the defaults below are ours.

The effort weights are `--length-penalty-weights`, parsed by
`parse_effort_weights` ("thinking=1,tool_call=1,tool_output=1,final=1,
tool_calls=0,turns=0", the defaults).

Samples are duck-typed: a term reads the attributes it needs (the verdict
terms a float of their own name, length `effort_counts: EffortCounts`). A new
term is a function sample -> float, added with `register_reward_term`; user
code brings its own with `--reward-module pkg.mod` (a module that registers
terms when imported) or by naming `pkg.mod:function` in `--reward`
(`import_reward_terms`). Both resolve by name, so every process that scores
(the driver, each Ray actor) finds the same terms by importing them itself.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor

# Below this |(1 - q) ln(1 + k x)| the division by (1 - q) is replaced by the
# series of expm1(z) / z; its first omitted term, z^3 / 24, is below 1e-25.
_SERIES_BELOW = 1e-8


def _expm1_over(z: Tensor) -> Tensor:
    """expm1(z) / z, continued by its series 1 + z/2 + z^2/6 where |z| is tiny (1 at z = 0)."""
    small = z.abs() < _SERIES_BELOW
    safe = torch.where(small, torch.ones_like(z), z)
    return torch.where(small, 1.0 + z / 2 + z * z / 6, torch.expm1(safe) / safe)


def length_penalty(x: Union[float, Tensor], k: float, q: float) -> Union[float, Tensor]:
    """C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)); at q = 1 its limit ln(1 + k x) / k.

    Computed as C = t / k * expm1(z) / z with t = log1p(k x) and z = (1 - q) t,
    which is exact at q = 1 and continuous (to float64 rounding) on both sides
    of it, and differentiable in x (C'(x) = (1 + k x)^(-q)).

    x: effort >= 0, a Python number (returns a float, computed in float64) or a
       tensor of any shape (returns the same shape; integer tensors become the default dtype).
    k: scale > 0 (1 / k is roughly where C starts to bend); q: curvature, finite.
    """
    if not (isinstance(k, (int, float)) and 0 < k < math.inf):
        raise ValueError(f"length penalty k {k!r} must be a finite number > 0 (e.g. 1e-3)")
    if not (isinstance(q, (int, float)) and math.isfinite(q)):
        raise ValueError(f"length penalty q {q!r} must be a finite number (0 is linear, 1 logarithmic)")
    as_float = not isinstance(x, Tensor)
    t = torch.tensor(float(x), dtype=torch.float64) if as_float else x
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    if not bool((t >= 0).all()):
        bad = x if as_float else t[~(t >= 0)].flatten()[0].item()
        raise ValueError(f"length penalty effort x {bad} must be >= 0 and not NaN; "
                         "check the effort counts and weights")
    log1p_kx = torch.log1p(k * t)
    value = log1p_kx / k * _expm1_over((1.0 - q) * log1p_kx)
    return value.item() if as_float else value


_EFFORT_FIELDS = ("thinking_tokens", "tool_call_tokens", "tool_output_tokens",
                  "final_message_tokens", "tool_calls", "turns")


@dataclass(frozen=True)
class EffortCounts:
    """What one rollout spent; filled by the loop and the agent environment."""

    thinking_tokens: int = 0
    tool_call_tokens: int = 0
    tool_output_tokens: int = 0
    final_message_tokens: int = 0
    tool_calls: int = 0
    turns: int = 0

    def __post_init__(self):
        for name in _EFFORT_FIELDS:
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"EffortCounts.{name} = {value} must be >= 0")


@dataclass(frozen=True)
class EffortWeights:
    """Weight of each effort count in x (from config). Defaults count every token once."""

    thinking_tokens: float = 1.0
    tool_call_tokens: float = 1.0
    tool_output_tokens: float = 1.0
    final_message_tokens: float = 1.0
    tool_calls: float = 0.0
    turns: float = 0.0

    def __post_init__(self):
        for name in _EFFORT_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"EffortWeights.{name} = {value!r} must be a finite number >= 0")


def effort(counts: EffortCounts, weights: EffortWeights) -> float:
    """x = sum over the six fields f of weights.f * counts.f (thinking, tool-call, tool-output
    and final-message tokens, tool calls, turns)."""
    return float(sum(getattr(weights, f) * getattr(counts, f) for f in _EFFORT_FIELDS))


# --length-penalty-weights keys -> EffortWeights fields
EFFORT_WEIGHT_KEYS = {"thinking": "thinking_tokens", "tool_call": "tool_call_tokens",
                      "tool_output": "tool_output_tokens", "final": "final_message_tokens",
                      "tool_calls": "tool_calls", "turns": "turns"}


def parse_effort_weights(spec: str) -> EffortWeights:
    """Parse `--length-penalty-weights` "thinking=1,tool_call=1,tool_output=1,final=1,tool_calls=0,turns=0".

    Keys (EFFORT_WEIGHT_KEYS): thinking, tool_call, tool_output and final weigh a
    token of thinking, tool calls, tool output and the final message; tool_calls
    and turns weigh each call and each model turn. A key left out keeps its
    EffortWeights default (tokens 1, calls and turns 0); "" is every default.
    """
    weights: dict[str, float] = {}
    for item in spec.split(",") if spec.strip() else []:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"--length-penalty-weights item {item.strip()!r} in {spec!r} is not key=weight; "
                             "write e.g. thinking=1,tool_call=1,tool_output=1,final=1,tool_calls=0,turns=0")
        if key not in EFFORT_WEIGHT_KEYS:
            raise ValueError(f"--length-penalty-weights: unknown key {key!r} in {spec!r}; "
                             f"use {', '.join(EFFORT_WEIGHT_KEYS)}")
        field_name = EFFORT_WEIGHT_KEYS[key]
        if field_name in weights:
            raise ValueError(f"--length-penalty-weights: {key!r} appears twice in {spec!r}; give it once")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"--length-penalty-weights: weight {value!r} of {key!r} is not a number") from None
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"--length-penalty-weights: weight of {key!r} is {weight}; "
                             "weights are finite numbers >= 0")
        weights[field_name] = weight
    return EffortWeights(**weights)


@dataclass(frozen=True)
class LengthPenaltyConfig:
    """k, q and the effort weights of the "length" reward term."""

    k: float = 1e-3
    q: float = 0.5
    weights: EffortWeights = field(default_factory=EffortWeights)

    def __post_init__(self):
        length_penalty(0.0, self.k, self.q)  # validates k and q with its own messages


RewardFn = Callable[[Any], float]


VERDICT_TERMS = ("correctness", "all_pass", "style", "communication", "tool_misuse", "parallel_tool_calls",
                 "tool_efficiency")


def verdict_term(name: str) -> RewardFn:
    """The term that reads the environment's verdict value `float(sample.<name>)`."""

    def term(sample: Any) -> float:
        try:
            value = getattr(sample, name)
        except AttributeError:
            raise ValueError(f"reward term {name!r} reads sample.{name}, which {type(sample).__name__} "
                             f"lacks; the environment's verdict must carry {name!r}, or drop it "
                             "from --reward") from None
        return float(value)

    term.__name__ = term.__qualname__ = f"{name}_term"
    return term


correctness_term = verdict_term("correctness")


def length_term(config: LengthPenaltyConfig) -> RewardFn:
    """The "length" term for `config`: sample -> -C(effort(sample.effort_counts, config.weights))."""

    def length(sample: Any) -> float:
        return -length_penalty(effort(sample.effort_counts, config.weights), config.k, config.q)

    return length


REWARD_TERMS: dict[str, RewardFn] = {}


def register_reward_term(name: str, fn: RewardFn, *, registry: Optional[dict[str, RewardFn]] = None,
                         replace: bool = False) -> None:
    """Add term `name` (fn: sample -> float) to `registry` (default REWARD_TERMS)."""
    registry = REWARD_TERMS if registry is None else registry
    if not name or any(c in name for c in ",= ") or not name.isprintable():
        raise ValueError(f"reward term name {name!r} must be non-empty without ',', '=' or spaces")
    if not callable(fn):
        raise ValueError(f"reward term {name!r}: {fn!r} is not callable; pass a function sample -> float")
    if name in registry and not replace:
        raise ValueError(f"reward term {name!r} is already registered; pass replace=True to override it")
    registry[name] = fn


for _verdict in VERDICT_TERMS:
    register_reward_term(_verdict, verdict_term(_verdict))
del _verdict
register_reward_term("length", length_term(LengthPenaltyConfig()))


def import_reward_terms(spec: str, *, registry: Optional[dict[str, RewardFn]] = None) -> list[str]:
    """Make user reward terms known in this process; returns the term names this call added.

    spec: a comma list of
      - "pkg.mod" (`--reward-module`): the module is imported; it registers its
        terms with `register_reward_term` when imported (REWARD_TERMS);
      - "pkg.mod:function": `function` (sample -> float) is registered under the
        name "pkg.mod:function" itself, as `--reward` names it.
    registry: where "pkg.mod:function" terms go (default REWARD_TERMS).

    Everything is found by name, so a process that did not run the driver's
    code (a Ray actor) gets the same terms by calling this with the same spec;
    the modules must be importable there (on its PYTHONPATH). Calling it again
    is harmless: a module is imported once per process and a function already
    registered under its name is kept.
    """
    registry = REWARD_TERMS if registry is None else registry
    added: list[str] = []
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        module_name, colon, attr = (part.strip() for part in entry.partition(":"))
        before = set(REWARD_TERMS)
        module = _import_user_module(module_name, entry)
        added += sorted(set(REWARD_TERMS) - before)
        if not colon:
            continue
        fn = getattr(module, attr, None) if attr else None
        if fn is None or not callable(fn):
            found = "has no attribute" if fn is None else f"has {type(fn).__name__} {attr!r}, not a function,"
            raise ValueError(f"reward term {entry!r}: module {module_name!r} {found} {attr!r}; "
                             "name a function sample -> float as package.module:function")
        if registry.get(entry) is not fn:
            register_reward_term(entry, fn, registry=registry)
            added.append(entry)
    return added


def _import_user_module(module_name: str, entry: str):
    if not module_name or any(not part.isidentifier() for part in module_name.split(".")):
        raise ValueError(f"reward module {entry!r} is not package.module or package.module:function")
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward module {module_name!r} (from {entry!r}) cannot be imported ({exc}); it must be "
                         "importable in every process that scores: put its folder on PYTHONPATH") from exc
    except Exception as exc:
        raise ValueError(f"reward module {module_name!r} (from {entry!r}) raised while importing: {exc!r}") from exc


def parse_reward_weights(spec: str, known: Optional[Iterable[str]] = None) -> dict[str, float]:
    """Parse `--reward` "correctness=1.0,length=0.001" into {"correctness": 1.0, "length": 0.001}.

    known: the accepted term names (default: REWARD_TERMS, where a
    "pkg.mod:function" name is first imported and registered by
    `import_reward_terms`). Spaces around items are ignored.
    """
    weights: dict[str, float] = {}
    for item in spec.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"--reward item {item.strip()!r} in {spec!r} is not name=weight; "
                             "write e.g. correctness=1.0,length=0.001")
        if known is None and ":" in name and name not in REWARD_TERMS:
            import_reward_terms(name)
        names = sorted(REWARD_TERMS if known is None else known)
        if name not in names:
            raise ValueError(f"unknown reward term {name!r} in --reward {spec!r}; known terms: {names} "
                             "(add yours with --reward-module pkg.mod, or name pkg.mod:function)")
        if name in weights:
            raise ValueError(f"reward term {name!r} appears twice in --reward {spec!r}; give it once")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"reward weight {value!r} of {name!r} is not a number") from None
        if not math.isfinite(weight):
            raise ValueError(f"reward weight of {name!r} is {weight}; weights must be finite")
        weights[name] = weight
    return weights


def combine_rewards(term_values: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """R = sum over the weighted terms n of weights[n] * term_values[n]."""
    missing = sorted(set(weights) - set(term_values))
    if missing:
        raise ValueError(f"no value for reward terms {missing}; got values for {sorted(term_values)}")
    total = 0.0
    for name, weight in weights.items():
        value = float(term_values[name])
        if not math.isfinite(value):
            raise ValueError(f"reward term {name!r} returned {value}; terms must return finite floats")
        total += weight * value
    return total


def score(samples: Iterable[Any], weights: Mapping[str, float],
          terms: Optional[Mapping[str, RewardFn]] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Rewards of N samples: (total [N] float32, {term name: [N] float32 values before weighting}).

    Only the terms named in `weights` are evaluated; terms defaults to REWARD_TERMS
    (for a configured length term: terms={**REWARD_TERMS, "length": length_term(config)}).
    """
    terms = REWARD_TERMS if terms is None else terms
    unknown = sorted(set(weights) - set(terms))
    if unknown:
        raise ValueError(f"reward terms {unknown} are not registered; known terms: {sorted(terms)}")
    totals: list[float] = []
    values: dict[str, list[float]] = {name: [] for name in weights}
    for sample in samples:
        term_values = {name: float(terms[name](sample)) for name in weights}
        totals.append(combine_rewards(term_values, weights))
        for name, value in term_values.items():
            values[name].append(value)
    return (torch.tensor(totals, dtype=torch.float32),
            {name: torch.tensor(v, dtype=torch.float32) for name, v in values.items()})



def reward_terms(reward) -> dict[str, RewardFn]:
    """Every registered term, with "length" configured by the length-penalty flags of `reward`
    (`config.RewardConfig`)."""
    config = LengthPenaltyConfig(k=reward.length_penalty_k, q=reward.length_penalty_q, weights=reward.effort_weights)
    return {**REWARD_TERMS, "length": length_term(config)}
