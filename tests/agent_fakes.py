"""Test doubles for the agent loop: a character tokenizer and a client that plays a script."""
from __future__ import annotations

import torch

from megatron_composer.inference.params import Completion

SPECIALS = {"system": 1, "user": 2, "assistant": 3, "end": 4}
EOD = 5
OFFSET = 16  # character c is id OFFSET + ord(c)


class CharTokenizer:
    """One id per character, so token counts are character counts."""

    chat = SPECIALS
    eod = EOD
    pad = 0
    vocab_size = OFFSET + 0x110000

    def role_ids(self, role: str) -> list[int]:
        return [SPECIALS[role]]

    def encode(self, text: str) -> list[int]:
        return [OFFSET + ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i - OFFSET) for i in ids if i >= OFFSET)


class ScriptedClient:
    """`RolloutClient` that answers call i with script[i] (+ <|end|>), logprob -0.5 per token.

    A script entry may be a tuple (text, "length") for a turn cut without its stop token.
    Records every prompt and SamplingParams it was given.
    """

    def __init__(self, tokenizer, script, *, version: int = 3, moe_shape=None):
        self.tok, self.script, self.version, self.moe_shape = tokenizer, list(script), version, moe_shape
        self.prompts, self.params = [], []

    def generate(self, prompts, params):
        (prompt,) = prompts
        self.prompts.append(list(prompt))
        self.params.append(params)
        entry = self.script[len(self.prompts) - 1]
        text, reason = entry if isinstance(entry, tuple) else (entry, "stop")
        ids = self.tok.encode(text) + ([self.tok.chat["end"]] if reason == "stop" else [])
        if len(ids) > params.max_tokens:  # cut by max_tokens, as an engine does
            ids, reason = ids[:params.max_tokens], "length"
        routes = None
        if self.moe_shape is not None:  # token t of this call routed to experts (call index, t)
            layers, topk = self.moe_shape
            n = len(prompt) + len(ids)
            routes = torch.full((n, layers, topk), len(self.prompts), dtype=torch.int32)
            routes[-1] = -1
        return [Completion(list(prompt), ids, [-0.5] * len(ids), [-0.5] * len(ids), routes,
                           [self.version] * len(ids), reason)]

    def update_weights(self, source, version=None):
        self.version = version
        return version
