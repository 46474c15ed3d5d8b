"""What a generation request asks for (`SamplingParams`) and what it gets back (`Completion`).

The fields and their meanings follow OpenAI's completions API and vLLM's
`SamplingParams` where they overlap (`temperature=0` is greedy, `top_k=0` and
`top_p=1` switch those filters off); the extension fields (`logprobs` at
the sampling temperature, `routed_experts`, `policy_versions`) are what RL needs.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

FINISH_REASONS = ("stop", "length")
SPECULATIVE_METHODS = (None, "mtp")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate one completion.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 is greedy (argmax); > 0 divides the logits.
        top_p: nucleus filter, in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        seed: per-request seed: the same seed, prompt and weights give the same
            tokens whatever else is batched with the request. None draws from
            the engine's own generator.
        stop_token_ids: ids that end the completion (the id is kept as its last token).
        stop: strings that end the completion (needs a tokenizer; the text is
            checked after each token, the tokens up to and including the one
            that completed the string are kept).
        logprobs: fill `Completion.logprobs` / `sampling_logprobs`.
        top_logprobs: also return the n most likely tokens of each position
            (the distribution of `Completion.logprobs`), as OpenAI's
            `top_logprobs`; 0: none.
        return_routed_experts: fill `Completion.routed_experts`.
        speculative: None or "mtp" (draft with the model's MTP layers).
        num_speculative_tokens: draft length with "mtp"; at most the model's
            MTP depth. None: the MTP depth.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    return_routed_experts: bool = False
    speculative: Optional[str] = None
    num_speculative_tokens: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError naming the bad field and what would fit."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}; use an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature={self.temperature!r}; use a number >= 0 (0 is greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}; use a number in (0, 1] (1 keeps every token)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}; use an integer >= 0 (0 keeps every token)")
        n = self.top_logprobs
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 20:
            raise ValueError(f"top_logprobs={n!r}; use an integer in [0, 20]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r}; use an integer or None")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={list(self.stop_token_ids)}; ids are >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r}; use non-empty strings")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative={self.speculative!r}; use one of {SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_speculative_tokens={k!r}; use an integer >= 1 (or None: the MTP depth)")


@dataclasses.dataclass
class SpeculativeStats:
    """Draft tokens proposed and accepted for one request (MTP speculative decoding).

    `acceptance_rate` = accepted / proposed; `tokens_per_step` = generated
    tokens / verification forwards (1.0 without speculation).
    """

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def tokens_per_step(self, generated: int) -> float:
        return generated / self.steps if self.steps else 0.0


@dataclasses.dataclass
class Completion:
    """One finished request.

    Attributes:
        prompt_token_ids: the prompt as given.
        token_ids: generated tokens only (a stop token id is included).
        logprobs: per generated token, its log-probability under the model's
            full distribution at the sampling temperature, log_softmax(logits / T)
            (no top-k / top-p; T = 1 for greedy, whose point mass says nothing):
            what the RL trainer recomputes (`sampling.token_logprobs`). Empty
            unless `SamplingParams.logprobs`.
        sampling_logprobs: per generated token, its log-probability under the
            distribution it was sampled from (temperature, top-k, top-p
            applied; 0.0 for greedy). MTP speculative sampling emits tokens
            with exactly this distribution too.
        top_logprobs: per generated token, [(token_id, logprob), ...] of the
            `SamplingParams.top_logprobs` most likely tokens (the distribution
            of `logprobs`), most likely first. Empty unless asked.
        routed_experts: int32 [len(prompt) + len(token_ids), num_moe_layers, topk]:
            the experts each token was routed to at every MoE layer of the
            decoder (MTP layers excluded), in the router's top-k order. The
            last generated token is never fed back through the model, so its
            row is -1 (replay falls back to the router there; no loss reads
            that position's output). None unless `return_routed_experts`.
        policy_versions: per generated token, the weights version whose
            forward produced its distribution.
        finish_reason: "stop" (a stop id or string) or "length" (max_tokens, or
            the engine's max_model_len).
        speculative: draft statistics with `speculative="mtp"`, else None.
        text: the decoded completion when the engine has a tokenizer, else None.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    routed_experts: Optional[torch.Tensor]
    policy_versions: list[int]
    finish_reason: str
    speculative: Optional[SpeculativeStats] = None
    text: Optional[str] = None
    request_id: Optional[str] = None
    top_logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GenerationEvent:
    """What one engine step added to one request (streaming).

    Delivered to `Engine.add_request(..., on_token=callback)` from the engine's
    thread after every step that produced tokens for the request. The lists
    are this step's new entries only (speculative steps can add several);
    `completion` is set on the last event (`finished` True); a request that
    failed ends with an event whose `error` says why (and no completion).
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    policy_versions: list[int]
    top_logprobs: list
    finished: bool = False
    completion: Optional[Completion] = None
    error: Optional[str] = None
