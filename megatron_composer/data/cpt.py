"""Packed continued-pretraining (CPT) samples from a megatron-core indexed dataset.

Packing follows Megatron-LM's GPTDataset without its blending and caching:
all documents (each ending in EOD) are one token stream, sample ``j`` is
stream ``[j*seq, j*seq + seq + 1)``, and samples are visited in a seeded
permutation. Positions reset at document starts, so a loop that attends
within ``cu_seqlens`` segments sees each document alone. The sample format
and the multi-epoch order are in ``data/packing.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import get_bin_path

from megatron_composer.data.indexed import document_offsets, open_indexed_dataset, read_tokens
from megatron_composer.data.packing import row_boundaries, sample_dict


def check_token_range(
    prefix: str, dtype: np.dtype, vocab_size: int, tokenizer_model: str | Path | None = None
) -> None:
    """Raise ValueError unless every token id of ``{prefix}.bin`` is in ``[0, vocab_size)``.

    An id outside the vocabulary would index past the embedding table: an
    opaque device-side assert on GPU, silent garbage on some kernels. It
    means the data was tokenized with another tokenizer.

    One vectorized pass over the memory-mapped file runs at disk / page-cache
    speed (GB/s) and allocates nothing the size of the file, once per
    construction: small next to the training run that reads the same file.
    """
    bin_path = get_bin_path(prefix)
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    which = f" (tokenizer {tokenizer_model})" if tokenizer_model is not None else ""
    fix = "preprocess it with the same tokenizer as the model, or fix --vocab-size"
    largest = int(tokens.max())
    if largest >= vocab_size:
        raise ValueError(f"{bin_path} holds token id {largest} >= vocab size {vocab_size}{which}; {fix}")
    if np.issubdtype(tokens.dtype, np.signedinteger):
        smallest = int(tokens.min())
        if smallest < 0:
            raise ValueError(f"{bin_path} holds negative token id {smallest}{which}; {fix}")


class CPTDataset(torch.utils.data.Dataset):
    """Packed continued-pretraining samples from a megatron-core indexed dataset.

    Args:
        prefix: indexed dataset prefix (``{prefix}.bin`` / ``{prefix}.idx``).
        seq_length: tokens per sample; each sample reads ``seq_length + 1``.
        seed: seeds the sample order.
        split: ``(start, end)`` fractions of the stream's samples (in stream
            order, before shuffling) this dataset uses, e.g. ``(0, 0.98)``
            and ``(0.98, 1)`` for disjoint train/valid sets from one file.
        vocab_size: when given, every token id of the file must be below it
            (checked once here; see ``check_token_range``).
        tokenizer_model: named in that check's error, to say which
            tokenizer the vocabulary comes from.
    """

    def __init__(
        self,
        prefix: str | Path,
        seq_length: int,
        seed: int = 1234,
        split: tuple[float, float] = (0.0, 1.0),
        vocab_size: int | None = None,
        tokenizer_model: str | Path | None = None,
    ):
        self.prefix = str(prefix)
        self.seq_length = int(seq_length)
        self.seed = seed
        self.indexed = open_indexed_dataset(prefix)
        offsets = document_offsets(self.indexed)
        self.num_documents = len(offsets) - 1
        self.num_tokens = int(offsets[-1])
        self.document_starts = offsets[:-1]
        if self.num_tokens < self.seq_length + 1:
            raise ValueError(
                f"{self.prefix} has {self.num_tokens} tokens, fewer than --seq-length {self.seq_length} + 1 "
                f"needed for one sample; add more data or use --seq-length <= {max(self.num_tokens - 1, 1)}"
            )
        if vocab_size is not None:
            check_token_range(self.indexed.path_prefix, self.indexed.index.dtype, vocab_size, tokenizer_model)
        stream_samples = (self.num_tokens - 1) // self.seq_length
        start, end = (int(round(f * stream_samples)) for f in split)
        if not 0 <= start < end <= stream_samples:
            raise ValueError(
                f"split {split} of {self.prefix} selects no samples (stream has {stream_samples} samples "
                f"of {self.seq_length} tokens); widen the split or lower --seq-length"
            )
        order = np.random.RandomState(seed).permutation(end - start)
        self.sample_rows = np.arange(start, end, dtype=np.int64)[order]

    def __len__(self) -> int:
        return len(self.sample_rows)

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(
                f"sample {index} out of range for {len(self)} samples of {self.prefix}; "
                "for multi-epoch runs index with epoch_index(consumed_samples, len(dataset), seed)"
            )
        row_start = int(self.sample_rows[index]) * self.seq_length
        chunk = read_tokens(self.indexed, row_start, self.seq_length + 1)
        cu_seqlens = row_boundaries(self.document_starts, row_start, self.seq_length)
        return sample_dict(chunk[:-1], chunk[1:], np.ones(self.seq_length, dtype=np.float32), cu_seqlens)
