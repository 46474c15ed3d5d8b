"""Writing and reading megatron-core indexed datasets (``.bin`` + ``.idx``).

The on-disk format is megatron-core's (``IndexedDatasetBuilder`` /
``IndexedDataset`` from 0.16.1), so the files work with Megatron-LM's own
loaders too. Each input text is one document holding one sequence: its token
ids followed by the tokenizer's EOD id. Empty texts are skipped.

What we add on top of megatron-core:

- atomic writes: the builder writes ``{prefix}.tmp<pid>.bin/.idx``; at the
  end the old ``.idx`` is removed, the new ``.bin`` and then the new ``.idx``
  are renamed into place. The ``.idx`` is the commit marker, so an
  interrupted run leaves either the old dataset, a new one, or no ``.idx``
  (reported as missing), never a half-written dataset under the final name;
- validation before opening: megatron-core reports a missing file as a bare
  ``AssertionError``, a truncated ``.idx`` as ``ValueError: buffer is smaller
  than requested size`` or ``struct.error``, a garbage one as ``bad header``,
  and does not notice a truncated ``.bin`` at all (reads fail later).
  ``open_indexed_dataset`` checks header, sizes and document indices first and
  raises ``IndexedDatasetError`` / ``FileNotFoundError`` naming the file and
  the fix;
- the flat token-stream view (``document_offsets``, ``read_tokens``) the CPT
  dataset packs from.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from megatron.core.datasets.indexed_dataset import (
    _INDEX_HEADER,
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from tqdm import tqdm

from megatron_composer.data.tokenizer import Tokenizer

# header (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_IDX_PREAMBLE_BYTES = 34


class IndexedDatasetError(ValueError):
    """An indexed dataset on disk is corrupt, truncated or inconsistent."""


def _rebuild_hint(prefix: str) -> str:
    return f"re-run `python tools/preprocess_data.py --output-prefix {prefix} ...` to rebuild it"


def normalize_prefix(prefix: str | Path) -> str:
    """The dataset prefix, tolerating a path that names the ``.bin`` or ``.idx`` file."""
    prefix = str(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


# ---------------------------------------------------------------- writing


def _encoded(
    texts: Iterable[str], tokenizer: Tokenizer, workers: int, batch: int = 64
) -> Iterator[list[int]]:
    """Token ids of each text, in input order, encoded ``batch`` texts at a time.

    SentencePiece's batch encode runs on ``workers`` C++ threads without the
    GIL, which beats a process pool here: no pickling, no worker start-up.
    """
    pending: list[str] = []
    for text in texts:
        pending.append(text)
        if len(pending) == batch:
            yield from tokenizer.encode_batch(pending, num_threads=workers)
            pending = []
    if pending:
        yield from tokenizer.encode_batch(pending, num_threads=workers)


def build_indexed_dataset(
    texts: Iterable[str],
    tokenizer: Tokenizer,
    prefix: str | Path,
    *,
    workers: int = 1,
    total: int | None = None,
    progress: bool = True,
    desc: str | None = None,
) -> dict:
    """Tokenize ``texts`` into ``{prefix}.bin`` / ``{prefix}.idx``, one document per text.

    Args:
        texts: documents; empty ones are skipped.
        tokenizer: appends ``tokenizer.eod`` to every document.
        prefix: output path without suffix; parent directories are created.
        workers: tokenizer threads (the output does not depend on the count).
        total: number of texts, for the progress bar only.

    Returns:
        ``{"prefix", "documents", "tokens"}``.
    """
    prefix = normalize_prefix(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f"{prefix}.tmp{os.getpid()}"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    documents = tokens = 0
    builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=dtype)
    try:
        bar = tqdm(total=total, unit="doc", desc=desc or Path(prefix).name, disable=not progress)
        with bar:
            for ids in _encoded(texts, tokenizer, workers):
                bar.update(1)
                if not ids:
                    continue
                ids.append(tokenizer.eod)
                # add_document is typed torch.Tensor but only calls numpy.array() on it
                builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                documents += 1
                tokens += len(ids)
        builder.finalize(get_idx_path(tmp_prefix))
        if documents == 0:
            raise ValueError(f"no non-empty documents to write to {prefix}; check the --input files")
        Path(get_idx_path(prefix)).unlink(missing_ok=True)
        os.replace(get_bin_path(tmp_prefix), get_bin_path(prefix))
        os.replace(get_idx_path(tmp_prefix), get_idx_path(prefix))
    finally:
        builder.data_file.close()
        for path in (get_bin_path(tmp_prefix), get_idx_path(tmp_prefix)):
            Path(path).unlink(missing_ok=True)
    return {"prefix": prefix, "documents": documents, "tokens": tokens}


# ---------------------------------------------------------------- reading


def validate_indexed_dataset(prefix: str | Path) -> None:
    """Raise ``FileNotFoundError`` / ``IndexedDatasetError`` unless ``prefix`` is a complete dataset.

    Checks, without megatron-core: both files exist; the ``.idx`` header,
    version and dtype; that the ``.idx`` size matches its counts; that the
    document indices start at 0, never decrease and end at the sequence
    count; and that the ``.bin`` size matches the sequence lengths.
    """
    prefix = normalize_prefix(prefix)
    idx_path, bin_path = Path(get_idx_path(prefix)), Path(get_bin_path(prefix))
    hint = _rebuild_hint(prefix)
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise FileNotFoundError(f"indexed dataset file {path} not found (prefix {prefix}); {hint}")
    idx_size = idx_path.stat().st_size
    with idx_path.open("rb") as stream:
        preamble = stream.read(_IDX_PREAMBLE_BYTES)
    if len(preamble) < _IDX_PREAMBLE_BYTES:
        raise IndexedDatasetError(f"index {idx_path} is truncated ({idx_size} bytes, no full header); {hint}")
    if preamble[:9] != _INDEX_HEADER:
        raise IndexedDatasetError(
            f"index {idx_path} is not a megatron indexed-dataset index (bad header); {hint}"
        )
    version, code, sequences, documents = struct.unpack("<QBQQ", preamble[9:])
    if version != 1:
        raise IndexedDatasetError(f"index {idx_path} has unsupported version {version}; {hint}")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise IndexedDatasetError(f"index {idx_path} has unknown dtype code {code}; {hint}") from None
    expected = _IDX_PREAMBLE_BYTES + 4 * sequences + 8 * sequences + 8 * documents
    # a multimodal index carries one extra int8 mode per sequence
    if idx_size not in (expected, expected + sequences):
        raise IndexedDatasetError(
            f"index {idx_path} is truncated or corrupt: {idx_size} bytes, but its header "
            f"({sequences} sequences, {documents} document indices) needs {expected}; {hint}"
        )
    index = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=_IDX_PREAMBLE_BYTES)
    document_indices = np.frombuffer(
        index, dtype=np.int64, count=documents, offset=_IDX_PREAMBLE_BYTES + 12 * sequences
    )
    if (
        documents < 2
        or document_indices[0] != 0
        or document_indices[-1] != sequences
        or np.any(np.diff(document_indices) < 0)
        or np.any(lengths < 0)
    ):
        raise IndexedDatasetError(f"index {idx_path} has inconsistent document indices or lengths; {hint}")
    bin_expected = int(lengths.sum(dtype=np.int64)) * np.dtype(dtype).itemsize
    bin_size = bin_path.stat().st_size
    if bin_size != bin_expected:
        raise IndexedDatasetError(
            f"data file {bin_path} has {bin_size} bytes but {idx_path} describes {bin_expected}; "
            f"the pair is truncated or from different runs; {hint}"
        )


def is_valid_indexed_dataset(prefix: str | Path) -> bool:
    try:
        validate_indexed_dataset(prefix)
    except (FileNotFoundError, IndexedDatasetError):
        return False
    return True


def open_indexed_dataset(prefix: str | Path) -> IndexedDataset:
    """Validate and open a megatron-core ``IndexedDataset`` (memory-mapped)."""
    prefix = normalize_prefix(prefix)
    validate_indexed_dataset(prefix)
    try:
        return IndexedDataset(prefix)
    except Exception as error:
        raise IndexedDatasetError(
            f"megatron-core could not open {prefix}: {error}; {_rebuild_hint(prefix)}"
        ) from error


def document_offsets(dataset: IndexedDataset) -> np.ndarray:
    """Token offsets of document starts in the flat token stream, plus the total.

    Returns:
        int64 [num_documents + 1]: ``offsets[d]`` is where document ``d``
        starts in the concatenation of all sequences; ``offsets[-1]`` is the
        total number of tokens.
    """
    sequence_starts = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
    return sequence_starts[np.asarray(dataset.document_indices, dtype=np.int64)]


def read_tokens(dataset: IndexedDataset, start: int, length: int) -> np.ndarray:
    """Tokens ``[start, start + length)`` of the flat token stream, crossing documents freely.

    The ``.bin`` of a megatron-core dataset is the concatenation of its
    sequences in order (its sequence pointers are cumulative), so a span of
    the stream is one contiguous read.

    Returns:
        int64 [length].
    """
    dtype = dataset.index.dtype
    array = dataset.bin_reader.read(dtype=dtype, count=length, offset=start * np.dtype(dtype).itemsize)
    return array.astype(np.int64)


def document_prefixes(prefix: str, count: int, length: int, min_length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` documents of the dataset at `prefix` that hold at
    least `min_length` tokens (held-out prompts for decoding measurements)."""
    dataset = open_indexed_dataset(prefix)
    offsets = document_offsets(dataset)
    prompts = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end - start >= min_length:
            prompts.append(read_tokens(dataset, int(start), length).tolist())
        if len(prompts) == count:
            return prompts
    raise ValueError(f"{prefix} has {len(prompts)} documents of >= {min_length} tokens; ask for fewer prompts "
                     f"or shorter prompts / completions")
