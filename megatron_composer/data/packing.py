"""Packing math and the sample format shared by every dataset of the training loop.

Every dataset returns the same sample dict (one packed row of ``seq`` tokens),
built by ``sample_dict``:

- ``tokens``       int64 [seq]  input ids
- ``labels``       int64 [seq]  ``tokens`` shifted left by one (next-token targets)
- ``loss_mask``  float32 [seq]  1.0 where the label is trained on
- ``position_ids`` int64 [seq]  restart at 0 at every document start
- ``cu_seqlens``   int32 [k+1]  document start offsets within the row, from 0
                                to ``seq`` (e.g. ``[0, 17, 300, 512]``)

``collate_packed`` stacks samples into a batch and turns the per-row
``cu_seqlens`` into THD-style offsets over the flattened batch (what
megatron-core's ``PackedSeqParams`` takes).

Multi-epoch: ``dataset[i]`` is defined for ``0 <= i < len(dataset)`` only.
The loop reads sample ``epoch_index(consumed_samples, len(dataset), seed)``;
epoch 0 is the dataset's own order and each later epoch a fresh seeded
permutation, so resuming needs nothing but ``consumed_samples``.

Permutations use ``numpy.random.RandomState``, whose streams numpy keeps
stable across versions, so a seed means the same order on every machine.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np
import torch


def packed_position_ids(cu_seqlens: np.ndarray) -> np.ndarray:
    """Positions that restart at every segment start.

    Args:
        cu_seqlens: int [k+1], segment starts from 0 to the row length.

    Returns:
        int64 [cu_seqlens[-1]], e.g. ``[0, 3, 5] -> [0, 1, 2, 0, 1]``.
    """
    cu_seqlens = np.asarray(cu_seqlens, dtype=np.int64)
    segment_start = np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens))
    return np.arange(cu_seqlens[-1], dtype=np.int64) - segment_start


def row_boundaries(document_starts: np.ndarray, row_start: int, seq_length: int) -> np.ndarray:
    """Document starts that fall inside stream row ``[row_start, row_start + seq_length)``.

    Args:
        document_starts: int64 [d], sorted token offsets of document starts in the stream.

    Returns:
        int32 [k+1]: 0, every document start strictly inside the row
        (relative to ``row_start``), and ``seq_length``.
    """
    lo = np.searchsorted(document_starts, row_start, side="right")
    hi = np.searchsorted(document_starts, row_start + seq_length, side="left")
    inner = np.asarray(document_starts[lo:hi], dtype=np.int64) - row_start
    return np.concatenate([[0], inner, [seq_length]]).astype(np.int32)


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.RandomState([seed, epoch]).permutation(num_samples)


def epoch_index(consumed_samples: int, num_samples: int, seed: int = 1234) -> int:
    """Dataset index of the ``consumed_samples``-th sample of a multi-epoch run.

    Epoch 0 (``consumed_samples < num_samples``) walks ``0, 1, 2, ...`` (the
    dataset is already shuffled); epoch ``e >= 1`` walks a permutation seeded
    by ``(seed, e)``.
    """
    epoch, offset = divmod(int(consumed_samples), num_samples)
    if epoch == 0:
        return offset
    return int(_epoch_permutation(num_samples, seed, epoch)[offset])


def sample_dict(tokens, labels, loss_mask, cu_seqlens) -> dict:
    """One sample in the format of the module docstring.

    Args:
        tokens, labels: int [seq] (numpy or torch).
        loss_mask: float [seq].
        cu_seqlens: int [k+1], document starts within the row, 0 to ``seq``.
    """
    return {
        "tokens": torch.as_tensor(tokens, dtype=torch.int64),
        "labels": torch.as_tensor(labels, dtype=torch.int64),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.float32),
        "position_ids": torch.from_numpy(packed_position_ids(cu_seqlens)),
        "cu_seqlens": torch.as_tensor(cu_seqlens, dtype=torch.int32),
    }


def collate_packed(samples: Sequence[dict]) -> dict:
    """Batch samples: [b, seq] tensors, plus THD ``cu_seqlens`` over the flattened batch.

    Returns:
        ``tokens``/``labels``/``position_ids`` int64 [b, seq], ``loss_mask``
        float32 [b, seq], ``cu_seqlens`` int32 [n+1] (row ``r``'s boundaries
        offset by ``r*seq``, shared row edges once), ``max_seqlen`` int.
    """
    batch = {
        key: torch.stack([s[key] for s in samples])
        for key in ("tokens", "labels", "loss_mask", "position_ids")
    }
    seq = batch["tokens"].shape[1]
    rows = [s["cu_seqlens"][:-1].to(torch.int64) + r * seq for r, s in enumerate(samples)]
    cu_seqlens = torch.cat(rows + [torch.tensor([len(samples) * seq])])
    batch["cu_seqlens"] = cu_seqlens.to(torch.int32)
    batch["max_seqlen"] = int(torch.diff(cu_seqlens).max())
    return batch
