"""Sampling math of the engine: pure functions of fp32 logits.

Ours rather than megatron-core's `TextGenerationController` sampling: that
one buckets requests by (temperature, top-k, top-p) and draws all of them
from one generator created on the CUDA device, where RL needs each request's
own seed (the same seed gives the same tokens whatever else is batched), the
log-prob of the distribution a token was drawn from, and the
speculative-sampling acceptance rule.

    sampling_logprobs(logits, temperature, top_k, top_p)
        log q = log_softmax(filter(logits / T)), -inf outside the kept set:
        top-k keeps the k largest (ties at the k-th value kept); top-p keeps
        the smallest most-likely-first prefix whose probability reaches p.
    temperature_logprobs(logits, temperature), token_logprobs(logits, labels, temperature)
        log_softmax(logits / T) over the full vocabulary (T = 1 for greedy):
        what the engine reports per token (`Completion.logprobs`) and what the
        RL trainer recomputes, so that the two are the same distribution
        whatever --temperature is (a ratio of log-probs at T = 1 against
        tokens drawn at T != 1 would be biased on every token).
    speculative_accept(p, q, draft, u)
        accept the draft token d (drawn from q) when u < min(1, p(d) / q(d));
        otherwise the token is drawn from the residual norm(max(p - q, 0)).
        The emitted token is then distributed exactly as p (Leviathan et al.
        2023, Chen et al. 2023).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..training.losses import token_log_probs


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are sampled from.

    Args:
        logits: [n, vocab] float32.
        temperature: > 0 (greedy is handled by the caller).
        top_k: 0 keeps every token.
        top_p: 1.0 keeps every token.
    Returns:
        [n, vocab] float32, -inf for filtered tokens; each row sums to 1 in probability.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} has no sampling distribution; greedy uses argmax")
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the most likely token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def logprob_temperature(temperature: float) -> float:
    """The temperature log-probs are reported at: `temperature`, or 1 for greedy (0), whose point mass
    has no informative log-probs of its own."""
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature={temperature!r}; use a number >= 0 (0 is greedy)")
    return float(temperature) if temperature > 0 else 1.0


def temperature_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) in float32 over the full vocabulary (no top-k / top-p); T = 1 when greedy.

    Args:
        logits: [n, vocab] (any float dtype).
        temperature: >= 0; 0 (greedy) reports the temperature-1 log-probs.
    Returns:
        [n, vocab] float32.
    """
    return torch.log_softmax(logits.float() / logprob_temperature(temperature), dim=-1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[labels], per row; differentiable in logits; T = 1 when greedy.

    The same values as `temperature_logprobs(logits, T).gather(-1, labels)`, computed
    in chunks of rows (`training.losses.token_log_probs`): fp32 lives one chunk at a
    time, and the gradient is written in the logits' dtype.

    Args:
        logits: [n, vocab] (any float dtype; computed in float32).
        labels: [n] int64 token ids.
        temperature: >= 0.
    Returns:
        [n] float32.
    """
    return token_log_probs(logits[None], labels[None], logprob_temperature(temperature))[0]


def sample(logprobs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of `logprobs` [n, vocab]; returns [n] int64."""
    return torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)


def uniform(generator: Optional[torch.Generator], device) -> float:
    """One U[0, 1) draw from `generator` (the acceptance test of a draft)."""
    return float(torch.rand((), generator=generator, device=device))


def speculative_accept(target_logprobs: torch.Tensor, draft_logprobs: torch.Tensor, draft: int, u: float):
    """The acceptance test of one draft token.

    Args:
        target_logprobs: [vocab] log p, the target's sampling distribution.
        draft_logprobs: [vocab] log q, the distribution `draft` was drawn from.
        draft: the drafted token id.
        u: a U[0, 1) draw.
    Returns:
        (accepted: bool, residual_logprobs: [vocab] log norm(max(p - q, 0)) or
        None when accepted).
    """
    p_d = float(target_logprobs[draft].exp())
    q_d = float(draft_logprobs[draft].exp())
    if q_d > 0 and u < min(1.0, p_d / q_d):
        return True, None
    residual = (target_logprobs.exp() - draft_logprobs.exp()).clamp_min(0)
    total = residual.sum()
    if float(total) <= 0:  # p == q up to rounding: the residual is p itself
        return False, target_logprobs
    return False, (residual / total).log()
