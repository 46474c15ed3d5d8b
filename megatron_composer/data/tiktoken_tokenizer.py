"""Kimi K2 / K2.5's tokenizer, read with `tiktoken` directly (no remote code).

Kimi publishes a tiktoken BPE (`tiktoken.model`: one "base64-token rank"
line per base token) and, in `tokenizer_config.json`, the names of its
special tokens (`added_tokens_decoder`: id -> content). Transformers loads
it only through the checkpoint's own `tokenization_kimi.py`; we rebuild the
same `tiktoken.Encoding` from the published data instead:

* base tokens: the ranks file, ids 0 .. N-1;
* special tokens: ids N .. N+257, named by `added_tokens_decoder`, the rest
  `<|reserved_token_{id}|>` (Kimi's numbering);
* pre-tokenization: Kimi's regex (`KIMI_PATTERN`, Han runs split from
  other letters, numbers in runs of at most 3 digits).

Text is encoded as plain text: a special token's spelling inside a document
is ordinary characters, never a control id (`encode_ordinary`), so data
cannot forge a turn boundary; the chat renderers place special ids
themselves. Like Kimi's tokenizer, text is encoded in pieces of at most
400,000 characters with no run of more than 25,000 whitespace or
non-whitespace characters (tiktoken's regex engine overflows on longer
ones); ordinary text never reaches those limits, so ids equal tiktoken's.

Chat roles. Kimi renders a message as
``<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`` (roles system,
user, assistant). `chat` maps our roles onto those tokens and `role_ids`
gives the whole header, so `data.sft.render_chat`, the agent and the server
write exactly Kimi's template:

    ours                     Kimi K2.5
    system                   <|im_system|>system<|im_middle|> ... <|im_end|>
    user                     <|im_user|>user<|im_middle|> ... <|im_end|>
    assistant                <|im_assistant|>assistant<|im_middle|> ... <|im_end|>
    end (stop id)            <|im_end|>
    eod (end of document)    [EOS]
    pad                      [PAD]

Tool calls are `data.tool_calls`' (see `kimi_tool_section` / `kimi_tool_calls`
there for Kimi's native `<|tool_calls_section_begin|>` format).
"""
from __future__ import annotations

import base64
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
NUM_SPECIAL = 256 + 2  # Kimi's reserved block after the base tokens
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_CHAT = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
             "end": "<|im_end|>"}
ROLE_MIDDLE = "<|im_middle|>"
MAX_CHARS = 400_000
MAX_RUN = 25_000
_RANK_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+$")


def is_tiktoken_file(path: str | Path) -> bool:
    """Whether `path` is a tiktoken ranks file (its first line is "base64 rank"), not a
    SentencePiece model (a protobuf)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).rstrip(b"\r\n")
    except OSError:
        return False
    return bool(_RANK_LINE.match(first))


def read_ranks(path: Path) -> dict[bytes, int]:
    """The base tokens of a tiktoken ranks file (read here, not through tiktoken's loader,
    which caches files by path under /tmp)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{number}: {line[:60]!r} is not a 'base64-token rank' line; "
                             "give Kimi's tiktoken.model") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1} without gaps; the file is damaged")
    return ranks


def _split_runs(text: str) -> Iterator[str]:
    """`text` in pieces of at most MAX_CHARS, none holding a run of more than MAX_RUN whitespace
    or non-whitespace characters (Kimi's limits for tiktoken's regex engine)."""
    for start in range(0, len(text), MAX_CHARS):
        chunk = text[start:start + MAX_CHARS]
        begin, run, space = 0, 0, chunk[:1].isspace()
        for i, char in enumerate(chunk):
            if char.isspace() != space:
                space, run = char.isspace(), 1
            else:
                run += 1
                if run > MAX_RUN:
                    yield chunk[begin:i]
                    begin, run = i, 1
        yield chunk[begin:]


class TiktokenTokenizer:
    """Kimi's tiktoken tokenizer behind `data.tokenizer.Tokenizer`'s interface (`Tokenizer(path)`
    returns one for a tiktoken ranks file). `tokenizer_config.json` must sit next to it (a converted
    checkpoint keeps both in `hf_assets/`; training copies both into its checkpoint root).

    Attributes:
        vocab_size: ids that can occur: the base tokens and the named special tokens (Kimi's
            model has 163,840 rows; the two reserved ids tiktoken adds after [PAD] are not
            counted).
    """

    def __init__(self, model_path: str | Path):
        import tiktoken

        self.model_path = Path(model_path)
        config_path = self.model_path.with_name(TOKENIZER_CONFIG)
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: a tiktoken tokenizer ({self.model_path}) needs "
                                    f"the {TOKENIZER_CONFIG} published with it, which names its special tokens; "
                                    "copy it next to the model file")
        config = json.loads(config_path.read_text())
        ranks = read_ranks(self.model_path)
        base = len(ranks)
        named = {int(i): entry["content"] for i, entry in (config.get("added_tokens_decoder") or {}).items()}
        outside = sorted(i for i in named if not base <= i < base + NUM_SPECIAL)
        if outside:
            raise ValueError(f"{config_path} names token id {outside[0]}, outside the special block "
                             f"{base}..{base + NUM_SPECIAL - 1} after {self.model_path}'s {base} base tokens; "
                             "the two files do not belong together")
        self.special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL)}
        self._enc = tiktoken.Encoding(name=self.model_path.name, pat_str=KIMI_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self.special)
        self.vocab_size = max([base - 1, *named]) + 1
        self.eod = self._special_id(_token_name(config.get("eos_token")) or "[EOS]")
        self.pad = self._special_id(_token_name(config.get("pad_token")) or "[PAD]")
        self.chat = {role: self._special_id(piece) for role, piece in KIMI_CHAT.items()}
        self.middle = self._special_id(ROLE_MIDDLE)

    def _special_id(self, piece: str) -> int:
        if piece not in self.special:
            raise ValueError(f"tokenizer {self.model_path} has no {piece!r} special token "
                             f"({self.model_path.with_name(TOKENIZER_CONFIG)} does not name it); Kimi's chat "
                             f"format needs {', '.join([*KIMI_CHAT.values(), ROLE_MIDDLE])}")
        return self.special[piece]

    def role_ids(self, role: str) -> list[int]:
        """Kimi's message header: <|im_role|> role <|im_middle|>."""
        return [self.chat[role], *self._enc.encode_ordinary(role), self.middle]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _split_runs(text):
            ids += self._enc.encode_ordinary(piece)
        return ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        if num_threads <= 1:
            return [self.encode(t) for t in texts]
        with ThreadPoolExecutor(num_threads) as pool:  # tiktoken releases the GIL
            return list(pool.map(self.encode, texts))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; EOD and padding decode to nothing, like SentencePiece's control
        symbols, other special tokens to their names."""
        return self._enc.decode([int(i) for i in ids if int(i) not in (self.eod, self.pad)])

    def id_to_piece(self, index: int) -> str:
        """The token's text; a lone byte that is not UTF-8 by itself is `<0xNN>` (SentencePiece's
        byte-piece spelling, which the server's logprobs understand)."""
        raw = self._enc.decode_single_token_bytes(int(index))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return f"<0x{raw[0]:02X}>" if len(raw) == 1 else raw.decode("utf-8", errors="replace")

    def __getstate__(self) -> dict:
        return {"model_path": str(self.model_path)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({str(self.model_path)!r}, vocab_size={self.vocab_size})"


def _token_name(value) -> str | None:
    """A tokenizer_config token entry: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value
