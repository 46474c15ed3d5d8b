"""CPT and SFT datasets for the training loop, and the embedded default data.

Both datasets return the same sample dict (one packed row of ``seq`` tokens):

- ``tokens``       int64 [seq]  input ids
- ``labels``       int64 [seq]  ``tokens`` shifted left by one (next-token targets)
- ``loss_mask``  float32 [seq]  1.0 where the label is trained on
- ``position_ids`` int64 [seq]  restart at 0 at every document start
- ``cu_seqlens``   int32 [k+1]  document start offsets within the row, from 0
                                to ``seq`` (e.g. ``[0, 17, 300, 512]``)

``collate_packed`` stacks samples into a batch and turns the per-row
``cu_seqlens`` into THD-style offsets over the flattened batch (what
megatron-core's ``PackedSeqParams`` takes).

CPT packing follows Megatron-LM's GPTDataset without its blending and
caching: all documents (each ending in EOD) are one token stream, sample
``j`` is stream ``[j*seq, j*seq + seq + 1)``, and samples are visited in a
seeded permutation. Positions reset at document starts, so a loop that
attends within ``cu_seqlens`` segments sees each document alone.

Multi-epoch: ``dataset[i]`` is defined for ``0 <= i < len(dataset)`` only.
The loop reads sample ``epoch_index(consumed_samples, len(dataset), seed)``;
epoch 0 is the dataset's own order and each later epoch a fresh seeded
permutation, so resuming needs nothing but ``consumed_samples``.

Permutations use ``numpy.random.RandomState``, whose streams numpy keeps
stable across versions, so a seed means the same order on every machine.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import sentencepiece
import torch

from megatron_composer.data.corpus import iter_texts, module_name, stdlib_corpus, stdlib_root
from megatron_composer.data.indexed import (
    build_indexed_dataset,
    document_offsets,
    is_valid_indexed_dataset,
    open_indexed_dataset,
    read_tokens,
)
from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer

CHAT_ROLES = ("system", "user", "assistant")


# ---------------------------------------------------------------- packing math


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


def _sample_dict(tokens, labels, loss_mask, cu_seqlens) -> dict:
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


# ---------------------------------------------------------------- CPT


class CPTDataset(torch.utils.data.Dataset):
    """Packed continued-pretraining samples from a megatron-core indexed dataset.

    Args:
        prefix: indexed dataset prefix (``{prefix}.bin`` / ``{prefix}.idx``).
        seq_length: tokens per sample; each sample reads ``seq_length + 1``.
        seed: seeds the sample order.
        split: ``(start, end)`` fractions of the stream's samples (in stream
            order, before shuffling) this dataset uses, e.g. ``(0, 0.98)``
            and ``(0.98, 1)`` for disjoint train/valid sets from one file.
    """

    def __init__(
        self, prefix: str | Path, seq_length: int, seed: int = 1234, split: tuple[float, float] = (0.0, 1.0)
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
        return _sample_dict(chunk[:-1], chunk[1:], np.ones(self.seq_length, dtype=np.float32), cu_seqlens)


# ---------------------------------------------------------------- SFT


def render_chat(messages: Sequence[dict], tokenizer: Tokenizer, add_generation_prompt: bool = False):
    """Token ids of a conversation and which of them are training targets.

    Each message is ``<|role|> content <|end|>``; a conversation ends with
    EOD. Targets are the assistant content tokens and the assistant's
    ``<|end|>`` (so the model learns to stop). With ``add_generation_prompt``
    the ids end with ``<|assistant|>`` instead of EOD, ready for generation.

    Returns:
        (ids: list[int], targets: list[bool]) of equal length.
    """
    ids: list[int] = []
    targets: list[bool] = []
    for message in messages:
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"message role {role!r} is not one of {CHAT_ROLES}")
        content = tokenizer.encode(message["content"])
        trained = role == "assistant"
        ids += [tokenizer.chat[role], *content, tokenizer.chat["end"]]
        targets += [False] + [trained] * len(content) + [trained]
    if add_generation_prompt:
        ids.append(tokenizer.chat["assistant"])
    else:
        ids.append(tokenizer.eod)
    targets.append(False)
    return ids, targets


def _read_conversations(path: Path) -> list[list[dict]]:
    conversations = []
    with path.open(encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(
                    f"{path}:{number} is not a JSON object with a 'messages' list ({error}); "
                    'expected {"messages": [{"role": "user", "content": "..."}, ...]}'
                ) from None
            conversations.append(messages)
    return conversations


class SFTDataset(torch.utils.data.Dataset):
    """Chat SFT samples with loss on assistant tokens only.

    Reads and tokenizes the whole JSONL file at construction (SFT sets are
    small). Conversations are shuffled by ``seed`` and, with ``pack=True``,
    packed greedily in that order into rows of ``seq_length + 1`` tokens;
    the rest of a row is ``tokenizer.pad`` with loss masked. A conversation
    longer than a row is truncated to it (counted in ``self.truncated``);
    one with no assistant tokens is dropped (``self.dropped``).

    Args:
        path: JSONL, one ``{"messages": [{"role", "content"}, ...]}`` per line.
        tokenizer: must have the chat tokens (trained by this package).
        seq_length: tokens per sample.
    """

    def __init__(
        self, path: str | Path, tokenizer: Tokenizer, seq_length: int, seed: int = 1234, pack: bool = True
    ):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"SFT data {self.path} not found; build the default with "
                "megatron_composer.data.default_sft_data(workdir) or pass a JSONL of chat messages"
            )
        self.seq_length = int(seq_length)
        self.pad = tokenizer.pad
        row = self.seq_length + 1
        self.truncated = self.dropped = 0
        self.conversations: list[tuple[np.ndarray, np.ndarray]] = []
        for messages in _read_conversations(self.path):
            ids, targets = render_chat(messages, tokenizer)
            if len(ids) > row:
                self.truncated += 1
                ids, targets = ids[:row], targets[:row]
            if not any(targets[1:]):
                self.dropped += 1
                continue
            self.conversations.append((np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool)))
        if not self.conversations:
            raise ValueError(
                f"{self.path} has no conversation with an assistant message; nothing to train on"
            )
        order = np.random.RandomState(seed).permutation(len(self.conversations))
        self.rows: list[list[int]] = []
        used = row
        for index in order.tolist():
            length = len(self.conversations[index][0])
            if not pack or used + length > row:
                self.rows.append([])
                used = 0
            self.rows[-1].append(index)
            used += length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} SFT samples of {self.path}")
        seq = self.seq_length
        ids = np.full(seq + 1, self.pad, dtype=np.int64)
        targets = np.zeros(seq + 1, dtype=bool)
        starts = []
        used = 0
        for conversation in self.rows[index]:
            conv_ids, conv_targets = self.conversations[conversation]
            starts.append(used)
            ids[used : used + len(conv_ids)] = conv_ids
            targets[used : used + len(conv_ids)] = conv_targets
            used += len(conv_ids)
        if used < seq:
            starts.append(used)
        cu_seqlens = np.asarray(starts + [seq], dtype=np.int32)
        return _sample_dict(ids[:-1], ids[1:], targets[1:].astype(np.float32), cu_seqlens)


def _strip_indent(text: str, indent: str) -> str:
    return "".join(
        line[len(indent) :] if line.startswith(indent) else line for line in text.splitlines(keepends=True)
    )


def _first_line(docstring: str | None) -> str:
    return (docstring or "").strip().split("\n")[0].strip()


def sft_examples_from_source(source: str, module: str, max_chars: int = 1400) -> list[tuple[str, list[dict]]]:
    """Synthetic coding conversations from one module's source, keyed for stable selection.

    - per documented top-level function or method of a top-level class: the
      user gives the signature and docstring, the assistant writes the body;
    - per module with at least two documented top-level definitions: the
      user asks what it defines, the assistant lists them with signatures.

    Returns:
        [(key, messages)], empty when ``source`` does not parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    examples = []
    candidates = [(None, node) for node in tree.body]
    candidates += [
        (cls.name, node) for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body
    ]
    for owner, node in candidates:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        if ast.get_docstring(node) is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        indent = lines[start - 1][: len(lines[start - 1]) - len(lines[start - 1].lstrip())]
        header = _strip_indent("".join(lines[start - 1 : node.body[0].end_lineno]), indent)
        body = _strip_indent("".join(lines[node.body[0].end_lineno : node.end_lineno]), indent)
        if not body.strip() or len(header) + len(body) > max_chars:
            continue
        name = f"{owner}.{node.name}" if owner else node.name
        kind = "method" if owner else "function"
        user = f"Complete the {kind} `{name}` from module `{module}`:\n\n```python\n{header.rstrip()}\n```"
        assistant = f"```python\n{body.rstrip()}\n```"
        examples.append(
            (
                f"{module}:{name}",
                [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
            )
        )
    listing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and ast.get_docstring(node):
            listing.append(f"- class `{node.name}`: {_first_line(ast.get_docstring(node))}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            listing.append(
                f"- function `{node.name}({ast.unparse(node.args)})`: {_first_line(ast.get_docstring(node))}"
            )
    answer = f"The module `{module}` defines:\n" + "\n".join(listing[:30])
    if len(listing) >= 2 and len(answer) <= max_chars:
        question = f"What does the module `{module}` define at the top level?"
        system = "You are an expert Python programmer. Answer concisely."
        examples.append(
            (
                f"{module}:__overview__",
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ],
            )
        )
    return examples


def build_sft_jsonl(
    path: str | Path, files: Sequence[str | Path], max_examples: int, root: Path | None = None
) -> int:
    """Write a deterministic synthetic chat SFT set built from Python source ``files``.

    Candidates from every file (``sft_examples_from_source``) are ordered by
    the sha1 of their ``module:name`` key and the first ``max_examples`` kept,
    so the set spreads over many modules and is the same on every machine.
    Written through a temporary name. Returns the number of examples.
    """
    candidates = []
    for file in files:
        try:
            source = Path(file).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        candidates += sft_examples_from_source(source, module_name(Path(file), root))
    candidates.sort(key=lambda item: hashlib.sha1(item[0].encode("utf-8")).hexdigest())
    chosen = candidates[:max_examples]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as stream:
            for _, messages in chosen:
                stream.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(chosen)


# ---------------------------------------------------------------- embedded default data


@dataclass(frozen=True)
class DefaultCPTData:
    """Where ``default_cpt_data`` put the tokenizer and the two indexed-dataset prefixes."""

    tokenizer_model: Path
    train_prefix: str
    valid_prefix: str


def _manifest(**settings) -> dict:
    return {
        "format": 1,
        "python": platform.python_version(),
        "sentencepiece": sentencepiece.__version__,
        **settings,
    }


def _cached(manifest_path: Path, expected: dict) -> bool:
    try:
        return json.loads(manifest_path.read_text()) == expected
    except (OSError, ValueError):
        return False


class _WorkdirLock:
    """Exclusive ``flock`` on the work directory, so concurrent ranks build once."""

    def __init__(self, workdir: Path):
        self.path = workdir / ".data.lock"

    def __enter__(self):
        self.stream = self.path.open("w")
        fcntl.flock(self.stream, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.stream, fcntl.LOCK_UN)
        self.stream.close()


def _log(message: str) -> None:
    print(f"[data] {message}", file=sys.stderr, flush=True)


def default_cpt_data(workdir: str | Path, vocab_size: int = 4096, progress: bool = True) -> DefaultCPTData:
    """Tokenizer and train/valid indexed datasets of the embedded stdlib corpus, built once.

    Builds ``{workdir}/tokenizer.model`` (trained on the train split),
    ``{workdir}/stdlib_train`` and ``{workdir}/stdlib_valid`` unless a
    manifest says they were built with the same settings, Python and
    sentencepiece versions and the files are valid. Uses the whole corpus
    (about 9 MB, 2.7M tokens at 4096 pieces); a cold build takes seconds.
    Safe to call from several processes on one machine (file lock); on a
    cluster call it on rank 0 and barrier.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result = DefaultCPTData(
        workdir / "tokenizer.model", str(workdir / "stdlib_train"), str(workdir / "stdlib_valid")
    )
    manifest_path = workdir / "stdlib_cpt.json"
    with _WorkdirLock(workdir):
        train_files, valid_files = stdlib_corpus("train"), stdlib_corpus("valid")
        expected = _manifest(
            vocab_size=vocab_size, train_files=len(train_files), valid_files=len(valid_files)
        )
        if (
            _cached(manifest_path, expected)
            and result.tokenizer_model.is_file()
            and is_valid_indexed_dataset(result.train_prefix)
            and is_valid_indexed_dataset(result.valid_prefix)
        ):
            _log(f"reusing stdlib CPT data in {workdir}")
            return result
        manifest_path.unlink(missing_ok=True)
        started = time.perf_counter()
        _log(f"training a {vocab_size}-piece BPE tokenizer on {len(train_files)} files of {stdlib_root()}")
        train_tokenizer(train_files, vocab_size, workdir / "tokenizer")
        tokenizer = Tokenizer(result.tokenizer_model)
        _log(f"tokenizer ready ({tokenizer.vocab_size} pieces) in {time.perf_counter() - started:.1f}s")
        for files, prefix in ((train_files, result.train_prefix), (valid_files, result.valid_prefix)):
            stats = build_indexed_dataset(
                iter_texts(files),
                tokenizer,
                prefix,
                workers=os.cpu_count() or 1,
                total=len(files),
                progress=progress,
            )
            _log(f"{prefix}: {stats['documents']} documents, {stats['tokens']} tokens")
        manifest_path.write_text(json.dumps(expected))
        _log(f"stdlib CPT data built in {time.perf_counter() - started:.1f}s")
    return result


def default_sft_data(
    workdir: str | Path, max_train_examples: int = 2000, max_valid_examples: int = 200
) -> tuple[Path, Path]:
    """Synthetic chat SFT JSONL from the stdlib train and valid splits, built once.

    Returns:
        (train_jsonl, valid_jsonl) in ``workdir``.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    train_path, valid_path = workdir / "stdlib_sft_train.jsonl", workdir / "stdlib_sft_valid.jsonl"
    manifest_path = workdir / "stdlib_sft.json"
    expected = _manifest(max_train_examples=max_train_examples, max_valid_examples=max_valid_examples)
    with _WorkdirLock(workdir):
        if _cached(manifest_path, expected) and train_path.is_file() and valid_path.is_file():
            return train_path, valid_path
        manifest_path.unlink(missing_ok=True)
        for split, path, limit in (
            ("train", train_path, max_train_examples),
            ("valid", valid_path, max_valid_examples),
        ):
            count = build_sft_jsonl(path, stdlib_corpus(split), limit)
            _log(f"{path}: {count} synthetic SFT conversations")
        manifest_path.write_text(json.dumps(expected))
    return train_path, valid_path


# ---------------------------------------------------------------- synthetic


class RandomTokenDataset(torch.utils.data.Dataset):
    """Seeded uniform random tokens in the CPT sample format (one document per
    row): for benchmarks and parallelism tests that need no real text."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (num_samples, seq_length + 1), generator=g)
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        row = self.data[index]
        seq = self.seq_length
        return _sample_dict(row[:-1], row[1:], torch.ones(seq), np.array([0, seq], dtype=np.int32))
