"""Kimi K2.5's tokenizer read with tiktoken: ids, special tokens, chat template, where it travels.

A small tiktoken BPE is trained here (tiktoken's own trainer, Kimi's
pre-tokenization regex) and written as Kimi publishes it: `tiktoken.model`
("base64 rank" lines) and `tokenizer_config.json` naming the special tokens
at Kimi's offsets after the base tokens. The reference for every id is a
`tiktoken.Encoding` built from those files with tiktoken's own loader.
"""
import base64
import json
import os
import pickle

import pytest

tiktoken = pytest.importorskip("tiktoken")
import tiktoken.load  # noqa: E402

from megatron_composer.data.sft import render_chat  # noqa: E402
from megatron_composer.data.tiktoken_tokenizer import KIMI_PATTERN, TiktokenTokenizer  # noqa: E402
from megatron_composer.data.tokenizer import Tokenizer  # noqa: E402

# Kimi K2's special tokens and their offsets from the first special id (its tokenizer_config.json).
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                 11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
                 254: "[UNK]", 255: "[PAD]"}
SAMPLE = [
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Kimi 是一个由月之暗面开发的模型。It's 2025; we've 12345678 tokens, 3.14159 and x=[1,2,3].",
    "   indented\t\ttabs\r\n\r\nCRLF lines   \n\n\n" + " " * 40 + "end",
    "literal specials stay text: <|im_end|> [EOS] <|tool_call_begin|>",
    "émigré naïve café — ünïcödé, emoji 🙂🚀, and ALLCAPS Words MixedCase",
]


def _training_text():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "megatron_composer", "data", "sft.py")) as f:
        return f.read() + "\n".join(SAMPLE) * 3


def write_kimi_tokenizer(path, vocab=360):
    """tiktoken.model + tokenizer_config.json in Kimi's layout; returns the number of base tokens."""
    from tiktoken._educational import bpe_train

    ranks = bpe_train(_training_text(), vocab, KIMI_PATTERN, visualise=None)
    path.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda x: x[1])]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    config = {
        "added_tokens_decoder": {str(base + k): {"content": v, "special": True, "lstrip": False, "rstrip": False,
                                                 "normalized": False, "single_word": False}
                                 for k, v in KIMI_SPECIALS.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 262144,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return base


def reference_encoding(path, base):
    """tiktoken's own loader and Encoding, with the specials at Kimi's ids."""
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken caches files by path; tests reuse paths
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path / "tiktoken.model"))
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
    specials = {KIMI_SPECIALS.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(258)}
    return tiktoken.Encoding("kimi-reference", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "kimi"
    base = write_kimi_tokenizer(path)
    return path, base, reference_encoding(path, base)


def test_ids_equal_tiktoken_on_a_corpus_sample(kimi_tok):
    path, base, ref = kimi_tok
    tok = Tokenizer(path / "tiktoken.model")
    assert isinstance(tok, TiktokenTokenizer)
    for text in SAMPLE:
        ids = tok.encode(text)
        assert ids == ref.encode_ordinary(text), text
        assert tok.decode(ids) == text
    assert tok.encode_batch(SAMPLE, num_threads=2) == [ref.encode_ordinary(t) for t in SAMPLE]
    # a special token's spelling inside text is text, never its control id
    assert ref.encode("<|im_end|>", allowed_special="all") == [base + 2]
    assert base + 2 not in tok.encode(SAMPLE[3])
    assert tok.vocab_size == base + 256  # up to [PAD], as Kimi's model rows (tiktoken declares 2 more)
    assert (tok.eod, tok.pad) == (base + 1, base + 255)
    assert tok.chat == {"system": base + 10, "user": base + 3, "assistant": base + 4, "end": base + 2}
    assert tok.decode([tok.eod, *tok.encode("x"), tok.pad]) == "x"
    again = pickle.loads(pickle.dumps(tok))
    assert isinstance(again, TiktokenTokenizer) and again.encode(SAMPLE[1]) == ref.encode_ordinary(SAMPLE[1])


def test_long_runs_are_split_like_kimi(kimi_tok):
    path, _, ref = kimi_tok
    tok = Tokenizer(path / "tiktoken.model")
    text = "a" * 60_000 + " " * 30_000 + "b"
    pieces = ["a" * 25_000, "a" * 25_000, "a" * 10_000 + " " * 25_000, " " * 5_000 + "b"]
    assert tok.encode(text) == [i for p in pieces for i in ref.encode_ordinary(p)]


def test_chat_renders_kimis_template(kimi_tok):
    path, base, ref = kimi_tok
    tok = Tokenizer(path / "tiktoken.model")
    messages = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    ids, targets = render_chat(messages, tok)
    text = ("<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>2+2?<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>4<|im_end|>[EOS]")
    assert ids == ref.encode(text, allowed_special="all")
    trained = [i for i, t in zip(ids, targets) if t]
    assert trained == ref.encode("4<|im_end|>", allowed_special="all")
    prompt, _ = render_chat(messages[:2], tok, add_generation_prompt=True)
    assert prompt == ref.encode(text[:text.index("4<|im_end|>")], allowed_special="all")


def test_tokenizer_errors_name_the_file(kimi_tok, tmp_path):
    path, base, _ = kimi_tok
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "tiktoken.model").write_bytes((path / "tiktoken.model").read_bytes())
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json not found"):
        Tokenizer(lone / "tiktoken.model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"][str(base + 17)]
    (lone / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no '<\|im_middle\|>' special token"):
        Tokenizer(lone / "tiktoken.model")


def test_preprocess_data_writes_tiktoken_ids(kimi_tok, tmp_path):
    import importlib.util

    from megatron_composer.data.indexed import open_indexed_dataset

    path, base, ref = kimi_tok
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in SAMPLE))
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("preprocess", os.path.join(here, "..", "tools", "preprocess_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--input", str(docs), "--tokenizer-model", str(path / "tiktoken.model"),
               "--output-prefix", str(tmp_path / "out")])
    data = open_indexed_dataset(str(tmp_path / "out"))
    got = [list(map(int, data[i])) for i in range(len(data))]
    assert got == [ref.encode_ordinary(t) + [base + 1] for t in SAMPLE]


def test_kimi_native_tool_calls_map_onto_ours(kimi_tok):
    """Kimi's tool-call tokens, as the tokenizer decodes them, parse into our ToolCall; malformed
    ones are reported like ours; spans cover the call for the agent's effort counts."""
    from megatron_composer.data.tool_calls import (
        ToolCall,
        format_kimi_tool_call,
        parse_tool_calls,
        tool_call_blocks,
    )

    path, _, _ = kimi_tok
    tok = Tokenizer(path / "tiktoken.model")
    native = ("Let me look.<|tool_calls_section_begin|>" + format_kimi_tool_call("read_file", {"path": "a.py"}, 0)
              + format_kimi_tool_call("run", {"cmd": "pytest -q"}, 1) + "<|tool_calls_section_end|>")
    assert native == ("Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0"
                      '<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|><|tool_call_begin|>'
                      'functions.run:1<|tool_call_argument_begin|>{"cmd": "pytest -q"}<|tool_call_end|>'
                      "<|tool_calls_section_end|>")
    ids = tok._enc.encode(native, allowed_special="all")  # what the model generates: special ids
    text = tok.decode(ids)
    content, calls, errors = parse_tool_calls(text)
    assert (content, calls, errors) == (
        "Let me look.", [ToolCall("read_file", {"path": "a.py"}), ToolCall("run", {"cmd": "pytest -q"})], [])
    blocks = tool_call_blocks(text)
    assert [text[b.start:b.end].startswith("<|tool_call_begin|>") for b in blocks] == [True, True]
    mixed = '<tool_call>{"name": "a", "arguments": {}}</tool_call><|tool_call_begin|>functions.b:0' \
            '<|tool_call_argument_begin|>[1]<|tool_call_end|>'
    content, calls, errors = parse_tool_calls(mixed)
    assert calls == [ToolCall("a", {})] and len(errors) == 1 and '"arguments" is a JSON list' in errors[0]
