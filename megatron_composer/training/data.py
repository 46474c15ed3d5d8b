"""Datasets for a stage: user data from flags, or the embedded stdlib corpus.

`stage_data(args, log)` resolves the tokenizer and the train/valid paths
(building the embedded corpus on rank 0 first when no --data-path is
given); `build_datasets(data, args, vocab_size)` opens them, checking every
token id against the model's vocabulary.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..config import get_stage
from ..data import CPTDataset, SFTDataset, Tokenizer, default_cpt_data, default_sft_data, validate_indexed_dataset


@dataclass
class StageData:
    tokenizer: Tokenizer
    kind: str  # "cpt" | "sft"
    train_path: str
    valid_path: Optional[str]


def _on_rank0_first(build):
    """Build cached data on rank 0 while the others wait, then let them reuse it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        result = build() if dist.get_rank() == 0 else None
        dist.barrier()
        return result if result is not None else build()
    return build()


def stage_data(args, log=print) -> StageData:
    """The tokenizer and data paths of args.stage (the embedded corpus by default)."""
    kind = get_stage(args.stage).data
    if args.data_path is None:
        default = _on_rank0_first(lambda: default_cpt_data(args.data_cache_dir, progress=False))
        tokenizer_model = args.tokenizer_model or default.tokenizer_model
        if kind == "cpt":
            train_path, valid_path = default.train_prefix, default.valid_prefix
        else:
            train_path, valid_path = _on_rank0_first(lambda: default_sft_data(args.data_cache_dir))
        log(f"> data: embedded Python standard-library corpus ({train_path})")
    else:
        if args.tokenizer_model is None:
            raise ValueError("--data-path needs --tokenizer-model (the sentencepiece .model "
                             "used by tools/preprocess_data.py)")
        tokenizer_model, train_path, valid_path = args.tokenizer_model, args.data_path, args.valid_data_path
    if not os.path.exists(tokenizer_model):
        raise ValueError(f"--tokenizer-model {tokenizer_model} does not exist; train one with "
                         "tools/train_tokenizer.py")
    return StageData(Tokenizer(tokenizer_model), kind, str(train_path),
                     str(valid_path) if valid_path is not None else None)


def build_datasets(data: StageData, args, vocab_size: int):
    """(train dataset, valid dataset or None) for the stage, token ids checked < vocab_size."""
    paths = [p for p in (data.train_path, data.valid_path) if p is not None]
    if data.kind == "cpt":
        for path in paths:
            validate_indexed_dataset(path)

        def make(path):
            return CPTDataset(path, args.seq_length, seed=args.seed, vocab_size=vocab_size,
                              tokenizer_model=str(data.tokenizer.model_path))
    else:
        for path in paths:
            if not Path(path).is_file():
                raise ValueError(f"SFT data {path} does not exist; pass a chat JSONL with "
                                 '{"messages": [...]} lines as --data-path')

        def make(path):
            return SFTDataset(path, data.tokenizer, args.seq_length, seed=args.seed, vocab_size=vocab_size)
    train = make(data.train_path)
    valid = make(data.valid_path) if data.valid_path is not None else None
    return train, valid
