"""Chat SFT: rendering conversations to tokens, reading chat JSONL, the SFT dataset.

A JSONL line is ``{"messages": [{"role": ..., "content": ...}, ...]}`` with
roles from ``CHAT_ROLES`` and at least one assistant message. Every line is
checked when the dataset is built, and a bad one raises ``ValueError``
``path:line: what is wrong; the fix``, so a typo in line 40,000 fails at
load, not as a ``KeyError`` deep in the loop. Samples use the format of
``data/packing.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from megatron_composer.data.corpus import jsonl_records
from megatron_composer.data.packing import sample_dict
from megatron_composer.data.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant")
_EXAMPLE_LINE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def render_chat(messages: Sequence[dict], tokenizer: Tokenizer, add_generation_prompt: bool = False):
    """Token ids of a conversation and which of them are training targets.

    Each message is ``<|role|> content <|end|>``; a conversation ends with
    EOD. Targets are the assistant content tokens and the assistant's
    ``<|end|>`` (so the model learns to stop). With ``add_generation_prompt``
    the ids end with ``<|assistant|>`` instead of EOD, ready for generation.
    The role opener is ``tokenizer.role_ids(role)``: one token for our
    tokenizer, Kimi's ``<|im_role|>role<|im_middle|>`` header for its tiktoken
    one (`tiktoken_tokenizer`).

    Returns:
        (ids: list[int], targets: list[bool]) of equal length.
    """
    ids: list[int] = []
    targets: list[bool] = []
    for message in messages:
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"message role {role!r} is not one of {CHAT_ROLES}; use one of them")
        content = tokenizer.encode(message["content"])
        trained = role == "assistant"
        opener = tokenizer.role_ids(role)
        ids += [*opener, *content, tokenizer.chat["end"]]
        targets += [False] * len(opener) + [trained] * len(content) + [trained]
    if add_generation_prompt:
        ids += tokenizer.role_ids("assistant")
    else:
        ids.append(tokenizer.eod)
    targets.append(False)
    return ids, targets


def _json_type(value) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def conversation_error(record) -> str | None:
    """What is wrong with one parsed JSONL record as a chat conversation, with the fix; None if nothing."""
    if not isinstance(record, dict):
        return f"the line is a JSON {_json_type(record)}, not an object; write {_EXAMPLE_LINE}"
    if "messages" not in record:
        return f'no "messages" key (keys: {sorted(record)}); write {_EXAMPLE_LINE}'
    messages = record["messages"]
    if not isinstance(messages, list):
        return f'"messages" is a JSON {_json_type(messages)}, not an array of messages; write {_EXAMPLE_LINE}'
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            kind = _json_type(message)
            return f'{where} is a JSON {kind}, not an object; write {{"role": ..., "content": ...}}'
        if "role" not in message:
            return f'{where} has no "role"; set it to one of {", ".join(CHAT_ROLES)}'
        if message["role"] not in CHAT_ROLES:
            return f'{where} has role {message["role"]!r}; use one of {", ".join(CHAT_ROLES)}'
        if "content" not in message:
            return f'{where} has no "content"; give the message text as a string'
        if not isinstance(message["content"], str):
            kind = _json_type(message["content"])
            return f'{where} "content" is a JSON {kind}, not a string; give the message text as a string'
    if not any(message["role"] == "assistant" for message in messages):
        return "no assistant message, so nothing to train on; add the assistant reply or remove the line"
    return None


def read_conversations(path: str | Path) -> list[tuple[int, list[dict]]]:
    """Every conversation of a chat JSONL file, checked.

    Blank lines are skipped. Raises ``ValueError`` ``path:line: problem; fix``
    (1-based line) for the first bad line, or ``path: ...`` for a file with
    no conversation at all.

    Returns:
        [(line number, messages)] in file order.
    """
    path = Path(path)
    conversations = []
    for number, record in jsonl_records(path, f"write one object per line, {_EXAMPLE_LINE}"):
        problem = conversation_error(record)
        if problem is not None:
            raise ValueError(f"{path}:{number}: {problem}")
        conversations.append((number, record["messages"]))
    if not conversations:
        raise ValueError(f"{path}: no conversations (the file is empty); write one {_EXAMPLE_LINE} per line")
    return conversations


class SFTDataset(torch.utils.data.Dataset):
    """Chat SFT samples with loss on assistant tokens only.

    Reads, checks (``read_conversations``) and tokenizes the whole JSONL file
    at construction (SFT sets are small). Conversations are shuffled by
    ``seed`` and, with ``pack=True``, packed greedily in that order into rows
    of ``seq_length + 1`` tokens; the rest of a row is ``tokenizer.pad`` with
    loss masked. A conversation longer than a row is truncated to it
    (counted in ``self.truncated``); one whose assistant tokens all fall past
    the cut is dropped (``self.dropped``).

    Args:
        path: JSONL, one ``{"messages": [{"role", "content"}, ...]}`` per line.
        tokenizer: must have the chat tokens (trained by this package).
        seq_length: tokens per sample.
        vocab_size: when given, every token id must be below it; only a
            tokenizer other than the model's can break this.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        seq_length: int,
        seed: int = 1234,
        pack: bool = True,
        vocab_size: int | None = None,
    ):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"SFT data {self.path} not found; build the default with "
                "megatron_composer.data.default_sft_data(workdir) or pass a JSONL of chat messages"
            )
        self.seq_length = int(seq_length)
        self.pad = tokenizer.pad
        fix = f"(tokenizer {tokenizer.model_path}); tokenize with the model's tokenizer or fix --vocab-size"
        row = self.seq_length + 1
        self.truncated = self.dropped = 0
        self.conversations: list[tuple[np.ndarray, np.ndarray]] = []
        for number, messages in read_conversations(self.path):
            ids, targets = render_chat(messages, tokenizer)
            if vocab_size is not None and max(ids) >= vocab_size:
                raise ValueError(
                    f"{self.path}:{number}: token id {max(ids)} >= vocab size {vocab_size} {fix}"
                )
            if len(ids) > row:
                self.truncated += 1
                ids, targets = ids[:row], targets[:row]
            if not any(targets[1:]):
                self.dropped += 1
                continue
            self.conversations.append((np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool)))
        if not self.conversations:
            raise ValueError(
                f"{self.path}: in every conversation the assistant tokens fall past --seq-length "
                f"{self.seq_length}, so nothing is left to train on; raise --seq-length or shorten prompts"
            )
        self.rows = self._pack(np.random.RandomState(seed).permutation(len(self.conversations)), row, pack)

    def _pack(self, order: np.ndarray, row: int, pack: bool) -> list[list[int]]:
        """Greedy packing of conversations, in ``order``, into rows of ``row`` tokens."""
        rows: list[list[int]] = []
        used = row
        for index in order.tolist():
            length = len(self.conversations[index][0])
            if not pack or used + length > row:
                rows.append([])
                used = 0
            rows[-1].append(index)
            used += length
        return rows

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
        return sample_dict(ids[:-1], ids[1:], targets[1:].astype(np.float32), cu_seqlens)
