"""What the base evals ask of a model, and the one implementation over our inference engine.

An eval model has

    window                      the longest token sequence it scores or generates in
    tokenizer                   encode / decode / eod / vocab_size (`data.Tokenizer`)
    logprobs(sequences)         per sequence of n ids, float64 [n - 1]: log p(ids[j + 1] | ids[:j + 1])
    generate(prompts, max_tokens, stop)
                                greedy completions (text, cut before `stop`)

`EvalModel` runs a megatron-core GPTModel (bare or inside the trainer's
DDP wrapper) through the inference engine's forward (`inference.runner`):
whole sequences on one replica, so it works under data and context
parallelism (CP replicates the weights) at TP = EP = 1 with the local layer
spec, the engine's own limits. Scoring is a prefill of up to `batch_size`
sequences in one forward (no cache reuse between calls); the output head
and log-softmax run `_LOGIT_ROWS` positions at a time, so no [n, vocab]
fp32 tensor larger than that is made. Everything runs under no_grad in eval
mode, which megatron-core's router reads as "count no tokens for the expert
bias and add no aux loss": evaluating does not change training.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..inference.engine import Engine
from ..inference.params import SamplingParams
from ..inference.runner import Segment

_LOGIT_ROWS = 1024


class EvalModel:
    """A GPTModel as an eval model (see the module docstring).

    Args:
        model: GPTModel from `models.build_model` or a trainer's wrapped model.
        model_config: its `config.ModelConfig`.
        tokenizer: the tokenizer it was trained with.
        window: context length (at most the model's max_position_embeddings).
        batch_size: sequences per forward and generation slots.
    """

    def __init__(self, model, model_config, tokenizer, window: int, batch_size: int = 8):
        if window > model_config.max_position_embeddings:
            raise ValueError(f"eval window {window} is longer than the model's max_position_embeddings "
                             f"{model_config.max_position_embeddings}; use a window <= that")
        if tokenizer.vocab_size > model_config.vocab_size:
            raise ValueError(f"tokenizer {tokenizer} has {tokenizer.vocab_size} pieces but the model's vocab_size "
                             f"is {model_config.vocab_size}; use the tokenizer the checkpoint was trained with")
        self.window, self.tokenizer, self.batch_size = window, tokenizer, batch_size
        self.engine = Engine(model, model_config, tokenizer, max_batch_size=batch_size, max_model_len=window,
                             prefill_chunk_size=window)
        self.runner = self.engine.runner

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        out = []
        for start in range(0, len(sequences), self.batch_size):
            out += self._score_batch([list(s) for s in sequences[start:start + self.batch_size]])
        return out

    def _score_batch(self, batch: list[list[int]]) -> list[torch.Tensor]:
        for seq in batch:
            if not 1 <= len(seq) <= self.window:
                raise ValueError(f"a scored sequence has {len(seq)} tokens; the eval window is {self.window}")
        device = self.runner.device
        tokens = torch.tensor([t for seq in batch for t in seq], dtype=torch.long, device=device)
        positions = torch.tensor([p for seq in batch for p in range(len(seq))], dtype=torch.long, device=device)
        segments = [Segment(slot, 0, len(seq)) for slot, seq in enumerate(batch)]
        hidden, _ = self.runner.trunk(tokens, positions, segments, record_experts=False)
        out, offset = [], 0
        for seq in batch:
            n = len(seq)
            out.append(self._target_logprobs(hidden[offset:offset + n - 1], tokens[offset + 1:offset + n]))
            offset += n
        return out

    def _target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden [n, h] at positions predicting targets [n] -> float64 [n] log-probs, on the host."""
        parts = [torch.zeros(0, dtype=torch.float64)]
        for i in range(0, targets.numel(), _LOGIT_ROWS):
            logits = self.runner.logits(hidden[i:i + _LOGIT_ROWS])  # float32 [rows, vocab]
            rows = torch.log_softmax(logits, dim=-1).gather(1, targets[i:i + _LOGIT_ROWS, None]).squeeze(1)
            parts.append(rows.double().cpu())
        return torch.cat(parts)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], stop: str) -> list[str]:
        """Greedy completions; each prompt plus its `max_tokens` must fit the window."""
        handles = [self.engine.add_request(list(p), SamplingParams(max_tokens=m, temperature=0, stop=(stop,)))
                   for p, m in zip(prompts, max_tokens)]
        while not all(h.done() for h in handles):
            self.engine.step()
        texts = [h.result().text for h in handles]
        return [text.split(stop)[0] for text in texts]
