"""Data pipeline: stdlib corpus split, code tokenizer, indexed datasets, CPT/SFT datasets."""

import importlib.util
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_composer.data import (
    CPTDataset,
    SFTDataset,
    build_sft_jsonl,
    collate_packed,
    default_cpt_data,
    epoch_index,
    packed_position_ids,
    render_chat,
    row_boundaries,
)
from megatron_composer.data import default as data_default
from megatron_composer.data.corpus import EXCLUDED_DIRS, is_held_out, stdlib_corpus, stdlib_root
from megatron_composer.data.indexed import (
    IndexedDatasetError,
    build_indexed_dataset,
    document_offsets,
    open_indexed_dataset,
    read_tokens,
)
from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stdlib_files():
    return stdlib_corpus("train")[:40]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, stdlib_files):
    prefix = tmp_path_factory.mktemp("tok") / "tiny"
    return Tokenizer(train_tokenizer(stdlib_files, 512, prefix, max_sentences=20_000))


@pytest.fixture(scope="module")
def texts(stdlib_files):
    return [p.read_text(encoding="utf-8") for p in stdlib_files[:12]]


@pytest.fixture(scope="module")
def cpt_prefix(tmp_path_factory, tokenizer, texts):
    prefix = str(tmp_path_factory.mktemp("cpt") / "docs")
    build_indexed_dataset(texts, tokenizer, prefix, progress=False)
    return prefix


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- corpus


def test_stdlib_split_is_deterministic_disjoint_and_filtered():
    train, valid = stdlib_corpus("train"), stdlib_corpus("valid")
    assert train == stdlib_corpus("train") and valid == stdlib_corpus("valid")
    assert not set(train) & set(valid)
    assert len(train) > 200 and 0 < len(valid) < 0.06 * (len(train) + len(valid))
    root = stdlib_root()
    for files in (train, valid):
        relative = [p.relative_to(root).as_posix() for p in files]
        assert relative == sorted(relative)
        assert all(not set(Path(r).parts[:-1]) & EXCLUDED_DIRS for r in relative)
    assert all(is_held_out(p.relative_to(root).as_posix()) for p in valid)
    with pytest.raises(ValueError, match="'test'"):
        stdlib_corpus("test")


def test_held_out_rule_matches_hash():
    import hashlib

    for path in ("os.py", "json/decoder.py", "asyncio/timeouts.py", "a/b/c.py"):
        digest = hashlib.sha1(path.encode()).hexdigest()
        assert is_held_out(path) == (int(digest[:8], 16) % 1000 < 20)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_python_source_exactly(tokenizer, stdlib_files):
    for path in stdlib_files[:40]:
        text = path.read_text(encoding="utf-8")
        assert tokenizer.decode(tokenizer.encode(text)) == text, path
    tricky = "def f(x):\r\n\tif x:  \n\n        return 'é → 🚀'   \n  \n\n\n# 12345\n<|endoftext|>"
    ids = tokenizer.encode(tricky)
    assert tokenizer.decode(ids) == tricky
    assert tokenizer.eod not in ids and tokenizer.pad not in ids
    assert max(ids) < tokenizer.vocab_size


def test_tokenizer_special_ids(tokenizer):
    ids = {tokenizer.eod, tokenizer.pad, *tokenizer.chat.values()}
    assert len(ids) == 6
    assert tokenizer.encode("<|user|>") == [tokenizer.chat["user"]]
    assert tokenizer.decode([tokenizer.chat["assistant"], tokenizer.eod]) == "<|assistant|>"
    assert len(tokenizer.encode("\n")) == 1 and len(tokenizer.encode("\n\n")) == 2
    assert tokenizer.vocab_size <= 512


def test_tokenizer_training_is_deterministic(tmp_path, stdlib_files):
    first = train_tokenizer(stdlib_files[:5], 400, tmp_path / "a", max_sentences=2000)
    second = train_tokenizer(stdlib_files[:5], 400, tmp_path / "sub" / "b", max_sentences=2000)
    assert first.read_bytes() == second.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["a.model", "a.vocab", "sub"]


def test_tokenizer_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_tokenizer.py"):
        Tokenizer(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="vocab_size 100"):
        train_tokenizer([], 100, tmp_path / "t")


# ---------------------------------------------------------------- indexed datasets


def test_preprocess_round_trip(tmp_path, tokenizer, texts):
    prefix = str(tmp_path / "rt")
    stats = build_indexed_dataset([texts[0], "", texts[1], "x = 1\n"], tokenizer, prefix, progress=False)
    assert stats["documents"] == 3
    expected = [tokenizer.encode(t) + [tokenizer.eod] for t in (texts[0], texts[1], "x = 1\n")]
    dataset = open_indexed_dataset(prefix)
    assert len(dataset) == 3
    assert list(dataset.document_indices) == [0, 1, 2, 3]
    for index, ids in enumerate(expected):
        assert dataset[index].tolist() == ids
    lengths = [len(ids) for ids in expected]
    assert document_offsets(dataset).tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    stream = read_tokens(dataset, 0, sum(lengths))
    assert stream.tolist() == sum(expected, [])
    assert sorted(os.listdir(tmp_path)) == ["rt.bin", "rt.idx"]


def test_preprocess_cli_files_dirs_and_jsonl(tmp_path, tokenizer):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "b.py").write_text("def b():\n    return 2\n")
    (src / "a.py").write_text("import os\n")
    (src / "notes.txt").write_text("ignored")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in ("first doc", "second\n  doc")))
    tool = _load_tool("preprocess_data")
    common = ["--tokenizer-model", str(tokenizer.model_path)]
    tool.main(["--input", str(src), *common, "--output-prefix", str(tmp_path / "code")])
    tool.main(
        [
            "--input",
            str(jsonl),
            "--json-key",
            "body",
            *common,
            "--output-prefix",
            str(tmp_path / "js"),
            "--workers",
            "2",
        ]
    )
    code = open_indexed_dataset(tmp_path / "code")
    assert [tokenizer.decode(code[i]) for i in range(len(code))] == [
        "import os\n",
        "def b():\n    return 2\n",
    ]
    js = open_indexed_dataset(tmp_path / "js")
    assert [tokenizer.decode(js[i]) for i in range(len(js))] == ["first doc", "second\n  doc"]
    assert js[0].tolist()[-1] == tokenizer.eod
    with pytest.raises(KeyError, match="docs.jsonl:1 has no key 'text'"):
        tool.main(["--input", str(jsonl), *common, "--output-prefix", str(tmp_path / "bad")])


def test_interrupted_build_keeps_the_old_dataset_and_no_temp_files(tmp_path, tokenizer):
    prefix = str(tmp_path / "ds")
    build_indexed_dataset(["a = 1\n", "b = 2\n"], tokenizer, prefix, progress=False)

    def failing_texts():
        yield "c = 3\n"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_indexed_dataset(failing_texts(), tokenizer, prefix, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]
    dataset = open_indexed_dataset(prefix)
    assert tokenizer.decode(dataset[1]) == "b = 2\n"


@pytest.mark.parametrize(
    "damage, file, message",
    [
        ("truncate_idx", "idx", "truncated"),
        ("truncate_idx_header", "idx", "truncated"),
        ("garbage_idx", "idx", "bad header"),
        ("truncate_bin", "bin", "has .* bytes"),
        ("missing_bin", "bin", "not found"),
        ("missing_idx", "idx", "not found"),
    ],
)
def test_damaged_dataset_errors_name_file_and_fix(tmp_path, tokenizer, texts, damage, file, message):
    prefix = tmp_path / "ds"
    build_indexed_dataset(texts[:3], tokenizer, prefix, progress=False)
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if damage == "truncate_idx":
        idx.write_bytes(idx.read_bytes()[:-5])
    elif damage == "truncate_idx_header":
        idx.write_bytes(idx.read_bytes()[:20])
    elif damage == "garbage_idx":
        idx.write_bytes(os.urandom(idx.stat().st_size))
    elif damage == "truncate_bin":
        bin_.write_bytes(bin_.read_bytes()[:100])
    elif damage == "missing_bin":
        bin_.unlink()
    else:
        idx.unlink()
    expected_type = FileNotFoundError if damage.startswith("missing") else IndexedDatasetError
    with pytest.raises(expected_type, match=message) as caught:
        CPTDataset(prefix, 16)
    text = str(caught.value)
    assert str(idx if file == "idx" else bin_) in text and "preprocess_data.py" in text


def test_missing_prefix_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere/data\.idx.*preprocess_data\.py"):
        open_indexed_dataset(tmp_path / "nowhere" / "data")


# ---------------------------------------------------------------- CPT


def test_packing_math_by_hand():
    assert packed_position_ids(np.array([0, 3, 5])).tolist() == [0, 1, 2, 0, 1]
    assert packed_position_ids(np.array([0, 4])).tolist() == [0, 1, 2, 3]
    starts = np.array([0, 10, 14, 30])
    assert row_boundaries(starts, 8, 8).tolist() == [0, 2, 6, 8]
    assert row_boundaries(starts, 10, 4).tolist() == [0, 4]
    assert row_boundaries(starts, 16, 8).tolist() == [0, 8]


def test_cpt_samples_shift_positions_and_boundaries(cpt_prefix, tokenizer):
    seq = 64
    dataset = CPTDataset(cpt_prefix, seq, seed=1)
    indexed = open_indexed_dataset(cpt_prefix)
    stream = read_tokens(indexed, 0, int(document_offsets(indexed)[-1]))
    assert len(dataset) == (len(stream) - 1) // seq
    seen_rows = set()
    for i in range(len(dataset)):
        sample = dataset[i]
        assert sample["tokens"].shape == (seq,) and sample["tokens"].dtype == torch.int64
        assert sample["labels"].dtype == torch.int64 and sample["position_ids"].dtype == torch.int64
        assert sample["loss_mask"].dtype == torch.float32 and bool((sample["loss_mask"] == 1).all())
        assert sample["cu_seqlens"].dtype == torch.int32
        row = int(dataset.sample_rows[i])
        seen_rows.add(row)
        window = torch.from_numpy(stream[row * seq : row * seq + seq + 1])
        assert torch.equal(sample["tokens"], window[:-1]) and torch.equal(sample["labels"], window[1:])
        cu = sample["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == seq and cu == sorted(set(cu))
        for boundary in cu[1:-1]:
            assert sample["tokens"][boundary - 1] == tokenizer.eod and sample["position_ids"][boundary] == 0
        expected_starts = (
            [0] + [t + 1 for t in range(seq - 1) if sample["tokens"][t] == tokenizer.eod] + [seq]
        )
        assert cu == expected_starts
        assert sample["position_ids"].tolist() == packed_position_ids(np.array(cu)).tolist()
    assert seen_rows == set(range(len(dataset)))
    with pytest.raises(IndexError, match="epoch_index"):
        dataset[len(dataset)]


def test_cpt_dataset_pickles_for_dataloader_workers(cpt_prefix):
    dataset = CPTDataset(cpt_prefix, 32, seed=5)
    clone = pickle.loads(pickle.dumps(dataset))
    assert all(torch.equal(clone[2][key], dataset[2][key]) for key in dataset[2])


def test_cpt_order_depends_only_on_seed(cpt_prefix):
    a, b, c = (
        CPTDataset(cpt_prefix, 32, seed=7),
        CPTDataset(cpt_prefix, 32, seed=7),
        CPTDataset(cpt_prefix, 32, seed=8),
    )
    assert a.sample_rows.tolist() == b.sample_rows.tolist() != c.sample_rows.tolist()
    assert torch.equal(a[3]["tokens"], b[3]["tokens"])
    assert sorted(a.sample_rows.tolist()) == sorted(c.sample_rows.tolist())


def test_cpt_split_fractions_are_disjoint(cpt_prefix):
    train, valid = CPTDataset(cpt_prefix, 32, split=(0.0, 0.9)), CPTDataset(cpt_prefix, 32, split=(0.9, 1.0))
    assert not set(train.sample_rows.tolist()) & set(valid.sample_rows.tolist())
    assert len(train) + len(valid) == len(CPTDataset(cpt_prefix, 32))


def test_cpt_too_little_data_error(tmp_path, tokenizer):
    prefix = tmp_path / "small"
    stats = build_indexed_dataset(["x = 1\n"], tokenizer, prefix, progress=False)
    with pytest.raises(ValueError, match=rf"has {stats['tokens']} tokens.*--seq-length 512.*more data"):
        CPTDataset(prefix, 512)


def test_cpt_token_ids_outside_vocab_fail_at_load(cpt_prefix, tokenizer):
    indexed = open_indexed_dataset(cpt_prefix)
    largest = int(read_tokens(indexed, 0, int(document_offsets(indexed)[-1])).max())
    CPTDataset(cpt_prefix, 32, vocab_size=largest + 1)
    with pytest.raises(
        ValueError,
        match=rf"docs\.bin holds token id {largest} >= vocab size {largest} "
        r"\(tokenizer tok/code\.model\); preprocess it with the same tokenizer",
    ):
        CPTDataset(cpt_prefix, 32, vocab_size=largest, tokenizer_model="tok/code.model")


def test_cpt_negative_token_ids_fail_at_load(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "signed")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    builder.add_document(np.array([5, 6, -3, 7] * 20, dtype=np.int32), [80])
    builder.finalize(f"{prefix}.idx")
    with pytest.raises(ValueError, match=r"signed\.bin holds negative token id -3.*same tokenizer"):
        CPTDataset(prefix, 16, vocab_size=100)


def test_epoch_index_and_collate(cpt_prefix):
    n = 10
    assert [epoch_index(i, n, seed=3) for i in range(n)] == list(range(n))
    second = [epoch_index(n + i, n, seed=3) for i in range(n)]
    third = [epoch_index(2 * n + i, n, seed=3) for i in range(n)]
    assert sorted(second) == sorted(third) == list(range(n)) and second != third
    assert second == [epoch_index(n + i, n, seed=3) for i in range(n)]
    dataset = CPTDataset(cpt_prefix, 32)
    samples = [dataset[0], dataset[1]]
    batch = collate_packed(samples)
    assert batch["tokens"].shape == (2, 32) and batch["loss_mask"].shape == (2, 32)
    expected = samples[0]["cu_seqlens"][:-1].tolist() + (samples[1]["cu_seqlens"] + 32).tolist()
    assert batch["cu_seqlens"].tolist() == expected and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == max(np.diff(expected))


# ---------------------------------------------------------------- SFT


def _conversation(i):
    return {
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": f"Write f{i}."},
            {"role": "assistant", "content": f"def f{i}():\n    return {i}\n"},
            {"role": "user", "content": "And a docstring?"},
            {"role": "assistant", "content": f'def f{i}():\n    """Return {i}."""\n    return {i}\n'},
        ]
    }


def test_sft_loss_mask_covers_exactly_assistant_tokens(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    conversations = [_conversation(i) for i in range(5)]
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    for pack in (False, True):
        dataset = SFTDataset(path, tokenizer, seq_length=256, seed=0, pack=pack)
        if not pack:
            assert len(dataset) == 5
        trained = []
        for i in range(len(dataset)):
            sample = dataset[i]
            mask = sample["loss_mask"].bool()
            assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
            assert bool((sample["labels"][sample["tokens"] == tokenizer.pad] == tokenizer.pad).all())
            assert not bool(mask[sample["labels"] == tokenizer.pad].any())
            cu = sample["cu_seqlens"].tolist()
            assert cu[0] == 0 and cu[-1] == 256
            assert sample["position_ids"].tolist() == packed_position_ids(np.array(cu)).tolist()
            trained.append(sample["labels"][mask].tolist())
        expected = []
        for index in np.random.RandomState(0).permutation(5):
            for message in conversations[index]["messages"]:
                if message["role"] == "assistant":
                    expected += tokenizer.encode(message["content"]) + [tokenizer.chat["end"]]
        assert sum(trained, []) == expected
    packed = SFTDataset(path, tokenizer, seq_length=256, seed=0, pack=True)
    assert len(packed) < 5


def test_sft_render_truncation_and_errors(tmp_path, tokenizer):
    ids, targets = render_chat([{"role": "user", "content": "hi"}], tokenizer, add_generation_prompt=True)
    assert ids[0] == tokenizer.chat["user"] and ids[-1] == tokenizer.chat["assistant"] and not any(targets)
    long = tmp_path / "long.jsonl"
    # the second conversation's assistant reply falls past the cut: truncated, then dropped
    late_reply = [{"role": "user", "content": "x = 1\n" * 40}, {"role": "assistant", "content": "y"}]
    long.write_text(json.dumps(_conversation(1)) + "\n" + json.dumps({"messages": late_reply}) + "\n")
    dataset = SFTDataset(long, tokenizer, seq_length=24)
    assert dataset.truncated == 2 and dataset.dropped == 1 and len(dataset) == 1
    assert dataset[0]["tokens"].shape == (24,)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no messages"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        SFTDataset(bad, tokenizer, 32)


GOOD_LINE = json.dumps(_conversation(0)) + "\n"
ROLES = r"one of system, user, assistant"


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"messages": [', r"invalid JSON \(.*\); write one object per line"),
        ("[1, 2]", r"the line is a JSON array, not an object; write \{"),
        ('{"text": "no messages"}', r"no \"messages\" key \(keys: \['text'\]\); write \{"),
        ('{"messages": "hi"}', r"\"messages\" is a JSON string, not an array of messages; write \{"),
        ('{"messages": ["hi"]}', r"messages\[0\] is a JSON string, not an object; write \{"),
        ('{"messages": [{"content": "x"}]}', rf"messages\[0\] has no \"role\"; set it to {ROLES}"),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}',
            rf"messages\[1\] has role 'tool'; use {ROLES}",
        ),
        ('{"messages": [{"role": "user"}]}', r"messages\[0\] has no \"content\"; give the message text"),
        (
            '{"messages": [{"role": "assistant", "content": ["a"]}]}',
            r"messages\[0\] \"content\" is a JSON array, not a string; give the message text",
        ),
        (
            '{"messages": [{"role": "user", "content": "x"}]}',
            r"no assistant message, so nothing to train on; add the assistant reply or remove the line",
        ),
    ],
)
def test_sft_bad_line_names_file_line_and_fix(tmp_path, tokenizer, line, problem):
    path = tmp_path / "chat.jsonl"
    # the bad line is line 3: blank lines count, so the number matches an editor's
    path.write_text(GOOD_LINE + "\n" + line + "\n" + GOOD_LINE)
    with pytest.raises(ValueError, match=rf"chat\.jsonl:3: {problem}"):
        SFTDataset(path, tokenizer, 64)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_sft_empty_file_names_file_and_fix(tmp_path, tokenizer, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"empty\.jsonl: no conversations \(the file is empty\); write one"):
        SFTDataset(path, tokenizer, 64)


def test_sft_token_ids_outside_vocab_fail_at_load(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text(GOOD_LINE + json.dumps(_conversation(1)) + "\n")
    SFTDataset(path, tokenizer, 64, vocab_size=tokenizer.vocab_size)
    line_one = [tokenizer.chat["end"], tokenizer.eod]
    for message in _conversation(0)["messages"]:
        line_one += [tokenizer.chat[message["role"]], *tokenizer.encode(message["content"])]
    largest = max(line_one)
    message = rf"chat\.jsonl:1: token id {largest} >= vocab size {largest} \(tokenizer .*tiny\.model\)"
    with pytest.raises(ValueError, match=message):
        SFTDataset(path, tokenizer, 64, vocab_size=largest)


def test_build_sft_jsonl_is_deterministic_real_code(tmp_path, stdlib_files):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    count = build_sft_jsonl(first, stdlib_files, max_examples=50)
    build_sft_jsonl(second, list(reversed(stdlib_files)), max_examples=50)
    assert 0 < count <= 50 and first.read_bytes() == second.read_bytes()
    records = [json.loads(line) for line in first.read_text().splitlines()]
    assert len(records) == count
    for record in records:
        roles = [m["role"] for m in record["messages"]]
        assert roles[-1] == "assistant" and "user" in roles
    completions = [r for r in records if r["messages"][0]["content"].startswith("Complete the")]
    assert completions and all("def " in r["messages"][0]["content"] for r in completions)
    assert all(r["messages"][1]["content"].startswith("```python\n") for r in completions)


# ---------------------------------------------------------------- embedded default data


def test_default_cpt_data_builds_once_and_rebuilds_when_damaged(tmp_path, monkeypatch, stdlib_files):
    monkeypatch.setattr(
        data_default,
        "stdlib_corpus",
        lambda split: stdlib_files[:20] if split == "train" else stdlib_files[20:23],
    )
    data = default_cpt_data(tmp_path, vocab_size=512, progress=False)
    assert Tokenizer(data.tokenizer_model).vocab_size <= 512
    assert (
        len(open_indexed_dataset(data.train_prefix)) > 0 and len(open_indexed_dataset(data.valid_prefix)) == 3
    )
    stamp = os.stat(f"{data.train_prefix}.bin").st_mtime_ns
    assert default_cpt_data(tmp_path, vocab_size=512, progress=False) == data
    assert os.stat(f"{data.train_prefix}.bin").st_mtime_ns == stamp
    Path(f"{data.valid_prefix}.idx").write_bytes(b"garbage")
    default_cpt_data(tmp_path, vocab_size=512, progress=False)
    assert len(open_indexed_dataset(data.valid_prefix)) == 3
