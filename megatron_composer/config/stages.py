"""Training stages of the recipe and the sequence lengths they imply.

A stage decides the sequence length, the kind of data and the recipe's
context-parallel size on a cluster. The `tiny` CPU preset keeps every
stage's shape with lengths divided by `TINY_LENGTH_DIVISOR` (512 / 4096).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """What a training stage decides, at full scale."""

    name: str
    seq_length: int
    data: str  # "cpt" (plain text) or "sft" (chat, loss on assistant tokens)
    context_parallel_size: int  # the recipe's CP for this stage on a cluster
    description: str


STAGES = {
    "cpt-32k": Stage("cpt-32k", 32768, "cpt", 1, "continued pretraining on code at 32K"),
    "cpt-256k": Stage("cpt-256k", 262144, "cpt", 8, "long-context extension to 256K"),
    "sft": Stage("sft", 32768, "sft", 1, "short SFT on coding tasks (loss on assistant tokens)"),
}

TINY_LENGTH_DIVISOR = 64


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; choose one of: {', '.join(STAGES)}")
    return STAGES[name]


def stage_seq_length(stage: str, model_preset: str) -> int:
    """The sequence length of `stage` for `model_preset` (tiny: divided by 64)."""
    length = get_stage(stage).seq_length
    return length // TINY_LENGTH_DIVISOR if model_preset == "tiny" else length


def tokenizer_sets_vocab(model_preset: str) -> bool:
    """The tiny presets take their vocabulary size from the tokenizer (the
    embedded corpus's 4096-piece BPE, or the user's); other presets keep
    theirs and only grow it when the tokenizer is larger."""
    return model_preset in ("tiny", "tiny-vllm")
