"""Seeded random-token samples for benchmarks and parallelism tests that need no real text."""

from __future__ import annotations

import numpy as np
import torch

from megatron_composer.data.packing import sample_dict


class RandomTokenDataset(torch.utils.data.Dataset):
    """Seeded uniform random tokens in the CPT sample format, one document per row.

    Args:
        num_samples: rows; ``dataset[i]`` is row ``i``.
        seq_length: tokens per sample (each row draws ``seq_length + 1``).
        vocab_size: ids are drawn from ``[0, vocab_size)``.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (num_samples, seq_length + 1), generator=g)
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        row = self.data[index]
        seq = self.seq_length
        return sample_dict(row[:-1], row[1:], torch.ones(seq), np.array([0, seq], dtype=np.int32))
