"""Rollout samples -> packed training micro-batches for the policy loss.

One sample is its prompt and completion as one token sequence x_0 .. x_{n-1}
(P prompt tokens). Position t predicts x_{t+1}, so the trained positions are
P - 1 .. n - 2 (in a multi-turn sample only those whose next token the model
generated, `loss_mask`: tool outputs are context), each carrying its sample's advantage and the log-prob the
sampler gave x_{t+1} (at the sampling temperature, `Completion.logprobs`, for
the train-vs-rollout mismatch and truncated importance sampling). The routing records of the engine travel per
token (`routed_experts[t]` = the experts x_t was routed to), so packing and
the zigzag context-parallel split (`parallel.zigzag_batch` splits every
per-token field) keep them aligned with their tokens.

A micro-batch is one "thd" packed sequence [1, T] of whole samples (each
attends only to itself). `plan_step` balances the samples across
data-parallel ranks by cost, then cuts each rank's share into micro-batches
under a token budget. Under expert parallelism (an all-to-all per MoE layer
of every forward) and FSDP (an all-gather per layer) the data-parallel ranks
run their forwards in lockstep, so a rank with fewer micro-batches than its
peers runs `filler_batch`es: a few pad tokens that train nothing (and, marked
in `padding_mask`, count toward no expert's load).

Samples wait in the async RL buffer, which goes into checkpoints, so a
sample (with its feedback hints and effort counts) turns into plain data
and back: `RolloutSample.to_dict()` holds only None, bool, int, float, str,
lists, tuples, dicts and tensors, which `torch.load(weights_only=True)` reads.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from ..parallel.zigzag_batch import packed_seq_params_for
from ..training.batches import Batch
from .rewards import EffortCounts


def plain_data(value: Any, where: str) -> Any:
    """`value` as None, bool, int, float, str, list, tuple, dict or tensor (numbers such as numpy
    scalars become Python numbers); TypeError naming `where` for anything else."""
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.Tensor):
        return value
    if type(value) in (list, tuple):
        return type(value)(plain_data(v, where) for v in value)
    if isinstance(value, dict):
        return {plain_data(k, where): plain_data(v, where) for k, v in value.items()}
    if isinstance(value, str):
        return str(value)
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):  # numpy scalars
        return plain_data(value.item(), where)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{where} holds {type(value).__name__} {value!r}, which a checkpoint cannot carry as plain "
                    "data; store numbers, strings, lists, dicts or tensors there")


@dataclass
class Hint:
    """A note for one target message of one training sample (a trajectory segment).

    start, end: the message's ids are the sample's `completion_ids[start:end]`;
    note_ids: `<|role|> hint <|end|>`, inserted before the <|assistant|> that opens it
    (`feedback.attach_hints` writes them);
    opener: how many ids that opening takes (`Tokenizer.role_ids("assistant")`: 1 for our
    tokenizer, 3 for Kimi's `<|im_assistant|>assistant<|im_middle|>`).
    """

    rules: tuple
    text: str
    start: int
    end: int
    note_ids: list
    opener: int = 1

    def to_dict(self) -> dict:
        return plain_data(dataclasses.asdict(self), "a feedback hint")

    @classmethod
    def from_dict(cls, data: dict) -> "Hint":
        return cls(tuple(data["rules"]), data["text"], data["start"], data["end"], list(data["note_ids"]),
                   int(data.get("opener", 1)))


@dataclass
class RolloutSample:
    """One scored completion of one prompt of a group."""

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]  # per completion token, log_softmax(logits / T) of the sampler
    routed_experts: Optional[torch.Tensor]  # int32 [len(prompt) + len(completion), moe layers, topk]
    policy_versions: list[int]
    finish_reason: str
    text: str = ""
    rewards: dict = dataclasses.field(default_factory=dict)  # term -> value
    reward: float = 0.0
    advantage: float = 0.0
    trajectory: int = -1  # index of its trajectory in the step; the segments of one share it
    loss_mask: Optional[list[int]] = None  # per completion token, 1: generated (trained); None: all
    effort: Optional[EffortCounts] = None  # of its trajectory (None: one turn of completion_ids)
    info: dict = dataclasses.field(default_factory=dict)  # per-trajectory metrics (agentic: turns, summaries, ...)
    hints: list = dataclasses.field(default_factory=list)  # Hint on its messages (textual feedback)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def to_dict(self) -> dict:
        """Every field as plain data (`plain_data`); the effort counts and hints as dicts."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["effort"] = None if self.effort is None else dataclasses.asdict(self.effort)
        fields["hints"] = [h.to_dict() for h in self.hints]
        return {name: plain_data(value, f"RolloutSample.{name}") for name, value in fields.items()}

    @classmethod
    def from_dict(cls, data: dict) -> "RolloutSample":
        """The inverse of `to_dict`."""
        fields = dict(data)
        if fields.get("effort") is not None:
            fields["effort"] = EffortCounts(**fields["effort"])
        fields["hints"] = [Hint.from_dict(h) for h in fields.get("hints", [])]
        return cls(**fields)


@dataclass
class RLBatch(Batch):
    """A `Batch` with per-token RL fields ([1, T] like the tokens).

    normalizer_share: this micro-batch's part of the policy loss's constant
    normalizer (the whole constant on one micro-batch of the step, 0 on the
    others), so the step's global count is exactly the normalizer.
    """

    advantages: Optional[torch.Tensor] = None  # [1, T] float32
    sampler_logp: Optional[torch.Tensor] = None  # [1, T] float32
    routed_experts: Optional[torch.Tensor] = None  # [1, T, moe layers, topk] int32, -1: not recorded
    ref_logp: Optional[torch.Tensor] = None  # [1, T] float32, filled by the loop when KL needs it
    old_logp: Optional[torch.Tensor] = None  # [1, T] float32, the weights before the step's first update
    feedback_rows: Optional[torch.Tensor] = None  # [1, T] int64: row of feedback_table, -1: no target
    feedback_table: Optional[object] = None  # feedback_loss.FeedbackTable of the target positions
    normalizer_share: float = 0.0
    filler: bool = False  # `filler_batch`: pad tokens only, run to keep the ranks' forwards in lockstep

    PAD_VALUES: ClassVar[dict] = {"advantages": 0.0, "sampler_logp": 0.0, "routed_experts": -1, "ref_logp": 0.0,
                                  "old_logp": 0.0, "feedback_rows": -1}

    def to(self, device, non_blocking: bool = True) -> "RLBatch":
        moved = super().to(device, non_blocking)
        extra = {name: getattr(self, name).to(device, non_blocking=non_blocking)
                 for name in ("advantages", "sampler_logp", "routed_experts", "ref_logp", "old_logp", "feedback_rows",
                              "feedback_table")
                 if getattr(self, name) is not None}
        return dataclasses.replace(moved, **extra)


def pack_samples(samples: list[RolloutSample], pad_token: int = 0) -> RLBatch:
    """Whole samples packed into one "thd" sequence [1, sum of lengths]."""
    tokens, labels, mask, positions, segments, adv, slp, routed = [], [], [], [], [], [], [], []
    with_routing = all(s.routed_experts is not None for s in samples)
    for index, s in enumerate(samples):
        ids = s.prompt_ids + s.completion_ids
        n, p = len(ids), len(s.prompt_ids)
        trained = torch.zeros(n)
        if s.loss_mask is None:
            trained[p - 1:n - 1] = 1.0
        else:  # multi-turn: only the tokens the model generated are targets
            trained[p - 1:n - 1] = torch.tensor(s.loss_mask[:n - p], dtype=torch.float32)
        logp = torch.zeros(n)
        logp[p - 1:n - 1] = torch.tensor(s.sampler_logprobs[:n - p], dtype=torch.float32) * trained[p - 1:n - 1]
        tokens.append(torch.tensor(ids))
        labels.append(torch.tensor(ids[1:] + [pad_token]))
        mask.append(trained)
        positions.append(torch.arange(n))
        segments.append(torch.full((n,), index))
        adv.append(trained * s.advantage)
        slp.append(logp)
        if with_routing:
            routed.append(s.routed_experts[:n].to(torch.int32))
    cat = lambda xs: torch.cat(xs)[None]  # noqa: E731
    return RLBatch(tokens=cat(tokens), labels=cat(labels), loss_mask=cat(mask), position_ids=cat(positions),
                   segment_ids=cat(segments), packed_seq_params=packed_seq_params_for([s.length for s in samples]),
                   advantages=cat(adv), sampler_logp=cat(slp),
                   routed_experts=cat(routed) if with_routing else None)


def filler_batch(tokens: int, pad_token: int = 0) -> RLBatch:
    """A micro-batch of one document of `tokens` pad tokens with loss mask 0 (every per-token RL field
    its pad value): its forward and backward join the peers' collectives and add nothing to a loss,
    a gradient, a metric or the expert-bias counts (every token is True in `padding_mask`)."""
    zeros = torch.zeros(1, tokens)
    return RLBatch(tokens=torch.full((1, tokens), pad_token), labels=torch.full((1, tokens), pad_token),
                   loss_mask=zeros, position_ids=torch.arange(tokens)[None],
                   segment_ids=torch.zeros(1, tokens, dtype=torch.long),
                   packed_seq_params=packed_seq_params_for([tokens]), advantages=zeros.clone(),
                   sampler_logp=zeros.clone(), padding_mask=torch.ones(1, tokens, dtype=torch.bool), filler=True)
