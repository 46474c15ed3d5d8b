"""The embedded default data: tokenizer, CPT indexed datasets and SFT JSONL from the stdlib.

Built once per work directory and reused while a manifest (settings, Python
and sentencepiece versions) matches and the files are valid, so every run
on a machine without data still trains on real code.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import sentencepiece

from megatron_composer.data.corpus import iter_texts, stdlib_corpus, stdlib_root
from megatron_composer.data.indexed import build_indexed_dataset, is_valid_indexed_dataset
from megatron_composer.data.synthetic_sft import build_sft_jsonl
from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer


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
