"""Datasets for a stage: user data from flags, or the embedded stdlib corpus."""
from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from ..data.datasets import CPTDataset, SFTDataset, default_cpt_data, default_sft_data
from ..data.indexed import validate_indexed_dataset
from ..data.tokenizer import Tokenizer
from .arguments import STAGES


def _on_rank0_first(build):
    """Build cached data on rank 0 while the others wait, then let them reuse it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        result = build() if dist.get_rank() == 0 else None
        dist.barrier()
        return result if result is not None else build()
    return build()


def build_datasets(args, log=print):
    """(train dataset, valid dataset or None, tokenizer vocab size) for args.stage."""
    stage = STAGES[args.stage]
    if args.data_path is None:
        default = _on_rank0_first(lambda: default_cpt_data(args.data_cache_dir, progress=False))
        tokenizer_model = args.tokenizer_model or default.tokenizer_model
        if stage.data == "cpt":
            train_path, valid_path = default.train_prefix, default.valid_prefix
        else:
            train_path, valid_path = _on_rank0_first(lambda: default_sft_data(args.data_cache_dir))
        log(f"> data: embedded Python standard-library corpus ({train_path})")
    else:
        if args.tokenizer_model is None:
            raise SystemExit("--data-path needs --tokenizer-model (the sentencepiece .model "
                             "used by tools/preprocess_data.py)")
        tokenizer_model, train_path, valid_path = args.tokenizer_model, args.data_path, args.valid_data_path
    if not os.path.exists(tokenizer_model):
        raise SystemExit(f"--tokenizer-model {tokenizer_model} does not exist; train one with "
                         "tools/train_tokenizer.py")
    tokenizer = Tokenizer(tokenizer_model)
    if stage.data == "cpt":
        for path in (train_path, valid_path):
            if path is not None:
                validate_indexed_dataset(path)
        make = lambda p: CPTDataset(p, args.seq_length, seed=args.seed)  # noqa: E731
    else:
        for path in (train_path, valid_path):
            if path is not None and not Path(path).is_file():
                raise SystemExit(f"SFT data {path} does not exist; pass a chat JSONL with "
                                 '{"messages": [...]} lines as --data-path')
        make = lambda p: SFTDataset(p, tokenizer, args.seq_length, seed=args.seed)  # noqa: E731
    try:
        train = make(train_path)
        valid = make(valid_path) if valid_path is not None else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    log(f"> data: {len(train)} training samples of {args.seq_length} tokens"
        + (f", {len(valid)} validation samples" if valid is not None else ""))
    return train, valid, tokenizer.vocab_size
