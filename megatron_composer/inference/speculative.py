"""MTP speculative decoding: the model's MTP layer drafts, the trunk verifies.

Per decoding step of a request whose last accepted token x_N is not yet fed:

1. draft: MTP layer 1 at position N - 1 combines the trunk's hidden state
   h_{N-1} with the embedding of x_N and predicts x_{N+1}; the draft d is
   drawn from that head's distribution q (argmax when greedy). The MTP layer
   keeps its own latent cache: positions up to N - 1 are fed to it once, with
   the trunk hidden states kept from the forwards that computed them.
2. verify: the trunk is fed [x_N, d] at positions N, N + 1 in the batch's one
   forward; its distributions p_N (for x_{N+1}) and p_{N+1} come out together.
3. accept: greedy keeps d when d = argmax p_N, so the output equals plain
   greedy decoding; sampling keeps d with probability min(1, p_N(d) / q(d))
   and otherwise draws from norm(max(p_N - q, 0)) (`sampling.speculative_accept`),
   so every emitted token is distributed exactly as p. After an accepted
   draft one more token comes from p_{N+1} for free.
4. the trunk cache keeps the latents of the fed tokens that were accepted;
   a rejected draft's latent is overwritten by the next step.

One draft token per step (the first MTP layer); `SpeculativeStats` counts
proposals, acceptances and verification steps per request.
"""
from __future__ import annotations

import torch

from .params import SamplingParams
from .runner import Segment
from .sampling import sample, sampling_logprobs, speculative_accept, uniform


class _DraftState:
    def __init__(self):
        self.mtp_len = 0  # MTP cache positions filled
        self.hidden = None  # trunk hidden states [n, h] of positions hidden_start ..
        self.hidden_start = 0
        self.draft: list[int] = []
        self.draft_logprobs = None  # [vocab] the distribution the draft was drawn from


class MTPDrafter:
    """Drafts with the runner's first MTP layer and verifies against the trunk (see module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self.engine_generator = None  # set by the engine

    def check(self, params: SamplingParams) -> None:
        depth = len(self.runner.mtp_layers)
        if not depth:
            raise ValueError("speculative='mtp' needs a model with MTP layers (mtp_num_layers >= 1); this one has "
                             "none; drop speculative or load a checkpoint trained with --mtp-num-layers")
        k = params.num_speculative_tokens
        if k not in (None, 1):
            raise ValueError(f"num_speculative_tokens={k}: MTP drafting proposes one token per step from the "
                             f"first MTP layer; use 1 (or None)")

    @staticmethod
    def _state(req) -> _DraftState:
        if req.drafter_state is None:
            req.drafter_state = _DraftState()
        return req.drafter_state

    def draft_tokens(self, req) -> list[int]:
        return list(req.drafter_state.draft) if req.params.speculative and req.drafter_state else []

    def keep_hidden(self, req, hidden: torch.Tensor, start: int) -> None:
        """Keep the trunk hidden states of positions start .. start + n - 1 until MTP has consumed them."""
        state = self._state(req)
        if state.hidden is None:
            state.hidden, state.hidden_start = hidden.clone(), start
        else:
            assert start == state.hidden_start + len(state.hidden), (start, state.hidden_start)
            state.hidden = torch.cat([state.hidden, hidden])

    def verify(self, req, toks: list[int], logits: torch.Tensor, generator) -> list[tuple[int, float]]:
        """Accept or reject the draft; returns the new tokens with their sampling log-probs."""
        state = self._state(req)
        draft = toks[1]
        p = req.params
        req.stats.proposed += 1
        req.stats.steps += 1
        if p.greedy:
            first = int(torch.argmax(logits[0]))
            if first != draft:
                out = [(first, 0.0)]
            else:
                out = [(draft, 0.0), (int(torch.argmax(logits[1])), 0.0)]
        else:
            target = sampling_logprobs(logits[:2], p.temperature, p.top_k, p.top_p)
            accepted, residual = speculative_accept(target[0], state.draft_logprobs, draft,
                                                    uniform(generator, logits.device))
            if accepted:
                bonus = int(sample(target[1:2], generator))
                out = [(draft, float(target[0, draft])), (bonus, float(target[1, bonus]))]
            else:
                token = int(sample(residual[None], generator))
                out = [(token, float(target[0, token]))]
        req.stats.accepted += len(out) - 1
        state.draft, state.draft_logprobs = [], None
        return out

    def draft(self, reqs, generator_of) -> None:
        """Feed each request's new positions to the MTP layer and draft its next token (one batched forward)."""
        if not reqs:
            return
        runner = self.runner
        device = runner.device
        segments, tokens, positions, hidden = [], [], [], []
        for req in reqs:
            state = self._state(req)
            pending = req.num_computed  # position of the last accepted, not yet fed token
            first = state.mtp_len
            rows = state.hidden[first - state.hidden_start:pending - state.hidden_start]
            segments.append(Segment(req.slot, first, pending - first))
            tokens += req.tokens[first + 1:pending + 1]
            positions += range(first, pending)
            hidden.append(rows)
            state.mtp_len = pending
            state.hidden, state.hidden_start = None, pending
        out = runner.mtp(0, torch.cat(hidden), torch.tensor(tokens, dtype=torch.long, device=device),
                         torch.tensor(positions, dtype=torch.long, device=device), segments)
        last = torch.tensor([sum(s.length for s in segments[:i + 1]) - 1 for i in range(len(segments))],
                            device=device)
        logits = runner.logits(out[last])
        for req, row in zip(reqs, logits):
            state, p = req.drafter_state, req.params
            if p.greedy:
                state.draft, state.draft_logprobs = [int(torch.argmax(row))], None
            else:
                q = sampling_logprobs(row[None], p.temperature, p.top_k, p.top_p)
                state.draft, state.draft_logprobs = [int(sample(q, generator_of(req)))], q[0]
