"""Base evals: rolling-window NLL against a plain forward, edit scripts and edit distance against
hand-worked examples, questions and their ranking, the run spread over ranks, the CLI, and
`pretrain_cpt.py --eval-base-interval` writing TensorBoard scalars.

References are independent of the code under test: a hand-listed set of windows scored by
`composer_forward` + log_softmax, known Levenshtein distances, hand-applied edits, a scripted
log-probability function whose argmax the test computes itself, a git repository built here.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_composer.eval.edits import (Edit, apply_edits, diff_edits, edit_distance, normalized_edit_distance,
                                          render_edits, split_lines)
from megatron_composer.eval.knowledge import build_questions, option_sequences, score_options, summarize_knowledge
from megatron_composer.eval.perplexity import Window, codebase_perplexity, rolling_windows
from megatron_composer.eval.sources import EvalSource, directory_source
from megatron_composer.eval.state_tracking import STOP, build_state_tasks, git_tasks, synthetic_tasks
from megatron_composer.eval.suite import BaseEvals, EvalConfig, scalars

REPO = Path(__file__).resolve().parents[1]


# ---- fakes: a byte tokenizer and a scripted model ------------------------------------------------

class ByteTokenizer:
    vocab_size, eod, model_path = 257, 256, "bytes"

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def scripted_logprob(token: int) -> float:
    return -((token * 7) % 11) / 10 - 0.05


class ScriptedLM:
    """log p(token) = scripted_logprob(token) whatever the context; generate answers from a table."""

    def __init__(self, window=256, answers=None):
        self.window, self.tokenizer, self.batch_size, self.answers = window, ByteTokenizer(), 4, answers or {}
        self.scored = []  # every sequence scored

    def logprobs(self, sequences):
        self.scored += [list(s) for s in sequences]
        return [torch.tensor([scripted_logprob(t) for t in s[1:]], dtype=torch.float64) for s in sequences]

    def generate(self, prompts, max_tokens, stop):
        texts = [self.tokenizer.decode(p) for p in prompts]
        return [next((a for key, a in self.answers.items() if text.endswith(key)), "") for text in texts]


def toy_source(n=10) -> EvalSource:
    """Modules of functions and methods with distinct signatures and returns."""
    funcs = "".join(f'def scale{i}(x{i}, factor={i}):\n    """Scale by {i}."""\n    y = x{i} * factor\n'
                    f'    return y + {i}\n\n' for i in range(n))
    methods = "class Box:\n" + "".join(f'    def get{i}(self, key{i}, default=None):\n        v = key{i} or default\n'
                                       f'        return (v, {i})\n\n' for i in range(n))
    return EvalSource("toy", (("a.py", funcs), ("b/box.py", methods)))


# ---- a real tiny model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(data_dir):
    from megatron_composer.data import Tokenizer

    return Tokenizer(Path(data_dir) / "tokenizer.model")


@pytest.fixture(scope="module")
def tiny(tokenizer):
    from megatron_composer.config import get_preset
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    cfg = get_preset("tiny").replace(num_layers=2, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=32,
                                     moe_shared_expert_intermediate_size=32, vocab_size=tokenizer.vocab_size,
                                     max_position_embeddings=512, init_method_std=0.05)
    env = init_distributed()
    initialize_parallel(ParallelLayout(world_size=env.world_size), seed=7)
    return build_model(cfg, ParallelLayout(world_size=env.world_size), seq_length=512).eval(), cfg


def reference_logprobs(model, ids) -> torch.Tensor:
    """log p(ids[j + 1] | ids[:j + 1]) by one plain forward over `ids`."""
    from megatron_composer.models import composer_forward

    t = torch.tensor([ids])
    with torch.no_grad():
        logits, _ = composer_forward(model, t, torch.arange(len(ids))[None])
    return torch.log_softmax(logits[0].double(), -1)[:-1].gather(1, t[0, 1:, None]).squeeze(1)


# ---- codebase perplexity --------------------------------------------------------------------------

def test_rolling_windows_score_every_token_once_with_context():
    # hand-worked: 150 tokens, window 64, stride 32
    assert rolling_windows(150, 64, 32) == [Window(0, 64, 1), Window(32, 96, 64), Window(64, 128, 96),
                                            Window(86, 150, 128)]
    for n, window, stride in [(2, 8, 4), (7, 8, 4), (8, 8, 4), (9, 8, 4), (100, 16, 5), (1000, 64, 63), (33, 4, 1)]:
        windows = rolling_windows(n, window, stride)
        scored = [t for w in windows for t in range(w.first, w.end)]
        assert sorted(scored) == list(range(1, n)), (n, window, stride)
        assert all(w.end - w.begin <= window for w in windows)
        assert all(w.first - w.begin >= window - stride for w in windows[1:])  # context of the first scored
    with pytest.raises(ValueError, match="stride 8"):
        rolling_windows(10, 8, 8)


def test_codebase_nll_equals_plain_forward(tiny, tokenizer):
    from megatron_composer.eval.lm import EvalModel

    model, cfg = tiny
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    # fits one window: one forward over the whole text
    lm = EvalModel(model, cfg, tokenizer, window=160)
    one = codebase_perplexity(lm, ids)
    want = -float(reference_logprobs(model, ids).sum())
    assert one["tokens"] == 149 and one["windows"] == 1
    assert one["total_nll"] == pytest.approx(want, rel=1e-6)
    # rolling, window 64 stride 32: the hand-listed windows of the test above
    rolled = codebase_perplexity(EvalModel(model, cfg, tokenizer, window=64), ids, stride=32)
    want = -sum(float(reference_logprobs(model, ids[b:e])[f - b - 1:].sum())
                for b, e, f in [(0, 64, 1), (32, 96, 64), (64, 128, 96), (86, 150, 128)])
    assert rolled["tokens"] == 149 and rolled["windows"] == 4
    assert rolled["total_nll"] == pytest.approx(want, rel=1e-6)
    assert rolled["nll_per_token"] == pytest.approx(want / 149, rel=1e-6)


# ---- state tracking -------------------------------------------------------------------------------

def test_edit_distance_known_values():
    for a, b, d in [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("same", "same", 0),
                    ("intention", "execution", 5)]:
        assert edit_distance(a, b) == edit_distance(b, a) == d
    assert normalized_edit_distance("kitten", "sitting") == pytest.approx(3 / 7)
    assert normalized_edit_distance("", "") == 0.0 and normalized_edit_distance("abc", "") == 1.0


def test_edits_apply_in_sequence_and_render():
    edits = [Edit(2, ("b",), ("B1", "B2")), Edit(1, (), ("z",)), Edit(5, ("c",), ()), Edit(6, (), ("end",))]
    assert apply_edits(["a", "b", "c", "d"], edits) == ["z", "a", "B1", "B2", "d", "end"]
    assert render_edits(edits[:3]) == ("Edit 1: replace line 2\n- b\n+ B1\n+ B2\n"
                                       "Edit 2: insert at line 1\n+ z\n"
                                       "Edit 3: delete line 5\n- c\n")
    with pytest.raises(ValueError, match="edit 1 .*expected \\['x'\\]"):
        apply_edits(["a", "b"], [Edit(1, ("x",), ())])
    old, new = split_lines("a\nb\nc\nd\ne\n"), split_lines("a\nB\nc\ne\nf\ng\n")
    assert apply_edits(old, diff_edits(old, new)) == new


def test_synthetic_tasks_are_deterministic_and_an_oracle_scores_zero():
    source = toy_source()
    tasks = synthetic_tasks(source, 6, 3, 120, seed=1)
    assert tasks == synthetic_tasks(source, 6, 3, 120, seed=1) != synthetic_tasks(source, 6, 3, 120, seed=2)
    assert len(tasks) == 6 and all(len(t.edits) == 3 and len("\n".join(t.original)) <= 120 for t in tasks)
    config = EvalConfig(evals=("state-tracking",), state_tasks=6, state_file_chars=120, seed=1)
    evals = BaseEvals(source, ByteTokenizer(), 2048, config)
    oracle = ScriptedLM(2048, {t.prompt(): t.truth for t in evals.tasks})
    result = evals.run(oracle)["state-tracking"]
    assert result["normalized_edit_distance"] == 0.0 and result["edit_distance"] == 0.0
    assert result["exact_match"] == 1.0 and result["tasks"] == 6 and result["truncated"] == 0
    # answering with the unedited file scores its distance to the truth
    lazy = ScriptedLM(2048, {t.prompt(): "\n".join(t.original) + "\n" for t in evals.tasks})
    result = evals.run(lazy)["state-tracking"]
    want = sum(edit_distance("\n".join(t.original) + "\n", t.truth) for t in evals.tasks) / 6
    assert result["edit_distance"] == pytest.approx(want) and result["exact_match"] == 0.0
    assert result["normalized_edit_distance"] == pytest.approx(result["unedited_normalized_edit_distance"])
    assert all(t.prompt().count(STOP) == 1 for t in evals.tasks)


def test_git_history_gives_successive_versions(tmp_path):
    versions = ["def f():\n    return 1\n", "def f():\n    x = 2\n    return x\n",
                "def f():\n    x = 3\n    return x\n\n\ndef g():\n    pass\n"]

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for i, text in enumerate(versions):
        (tmp_path / "m.py").write_text(text)
        (tmp_path / "notes.txt").write_text(f"v{i}")
        git("add", ".")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"v{i}")
    source = directory_source(tmp_path)
    assert source.git_root is not None and [p for p, _ in source.files] == ["m.py"]
    tasks = git_tasks(source, 10, 1000)
    assert tasks == git_tasks(source, 10, 1000) == build_state_tasks(source, 10, 3, 1000)
    pairs = sorted((t.original, tuple(split_lines(t.truth))) for t in tasks)
    assert pairs == sorted((tuple(split_lines(a)), tuple(split_lines(b))) for a, b in zip(versions, versions[1:]))
    assert all(t.origin.startswith("git ") and t.path == "m.py" for t in tasks)


# ---- knowledge ------------------------------------------------------------------------------------

def test_questions_are_deterministic_with_one_correct_option():
    source = toy_source()
    questions = build_questions(source, 8, options=4, seed=3)
    assert questions == build_questions(source, 8, options=4, seed=3) != build_questions(source, 8, options=4, seed=4)
    assert len(questions) == 8 and {q.kind for q in questions} == {"signature", "return"}
    for q in questions:
        assert len(set(q.options)) == 4 and 0 <= q.answer < 4
        i = int(q.key.rsplit("scale", 1)[-1]) if "scale" in q.key else int(q.key.rsplit("get", 1)[-1])
        name = f"scale{i}" if "scale" in q.key else f"get{i}"
        truth = {("signature", "scale"): f"def scale{i}(x{i}, factor={i}):\n",
                 ("signature", "get"): f"    def get{i}(self, key{i}, default=None):\n",
                 ("return", "scale"): f"    return y + {i}\n",
                 ("return", "get"): f"        return (v, {i})\n"}[q.kind, name.rstrip("0123456789")]
        assert [o for o in q.options if o == truth] == [truth] and q.options[q.answer] == truth
        if q.kind == "signature":
            assert all(o.lstrip().startswith(f"def {name}(") for o in q.options)
        else:
            assert q.prompt.endswith("\n") and truth not in q.prompt


def test_knowledge_picks_the_most_likely_option():
    source = toy_source()
    evals = BaseEvals(source, ByteTokenizer(), 256, EvalConfig(evals=("knowledge",), knowledge_questions=8))
    result = evals.run(ScriptedLM(256))["knowledge"]
    expect, expect_mean = [], []
    for q in evals.questions:
        sums = [sum(scripted_logprob(b) for b in o.encode()) for o in q.options]
        means = [s / len(o.encode()) for s, o in zip(sums, q.options)]
        expect.append(sums.index(max(sums)) == q.answer)
        expect_mean.append(means.index(max(means)) == q.answer)
    assert result["questions"] == 8 and result["correct"] == sum(expect)
    assert result["accuracy"] == sum(expect) / 8 and result["accuracy_per_token"] == sum(expect_mean) / 8
    assert 0 < sum(expect) < 8  # the scripted model neither always nor never agrees


def test_knowledge_option_scores_equal_plain_forward(tiny, tokenizer):
    from megatron_composer.eval.lm import EvalModel

    model, cfg = tiny
    questions = build_questions(toy_source(), 1)
    seqs = [option_sequences(q, tokenizer, 64) for q in questions]
    got = score_options(EvalModel(model, cfg, tokenizer, 64, batch_size=3), seqs)
    for question_seqs, row in zip(seqs, got):
        for (ids, n), (score, count) in zip(question_seqs, row):
            assert count == n and len(ids) <= 64
            assert score == pytest.approx(float(reference_logprobs(model, ids)[-n:].sum()), rel=1e-6)
    assert summarize_knowledge(questions, got)["questions"] == 1


# ---- the run over ranks ---------------------------------------------------------------------------

def _all_evals(window=2048):
    cfg = EvalConfig(state_tasks=5, state_file_chars=150, knowledge_questions=6, stride=100)
    return BaseEvals(toy_source(), ByteTokenizer(), window, cfg)


def _run_on_rank(rank, world_size):
    evals = _all_evals()
    return evals.run(ScriptedLM(2048, {t.prompt(): t.truth[: 10 * (i + 1)] for i, t in enumerate(evals.tasks)}),
                     rank, world_size)


def test_ranks_share_the_items_and_agree():
    from tests.distributed import run_distributed

    evals = _all_evals()
    lm = ScriptedLM(2048, {t.prompt(): t.truth[: 10 * (i + 1)] for i, t in enumerate(evals.tasks)})
    single = evals.run(lm)
    # every window scored once; the NLL is the scripted one over every token after the first
    assert sorted(len(s) for s in lm.scored[:len(evals.windows)]) == sorted(w.end - w.begin for w in evals.windows)
    assert single["codebase-ppl"]["total_nll"] == pytest.approx(-sum(scripted_logprob(t) for t in evals.tokens[1:]))
    assert 0 < single["state-tracking"]["normalized_edit_distance"] < 1
    assert set(scalars(single)) == {"base-eval/codebase-nll-per-token", "base-eval/codebase-total-nll",
                                    "base-eval/state-tracking-edit-distance",
                                    "base-eval/state-tracking-edit-distance-raw", "base-eval/knowledge-accuracy"}
    assert run_distributed(_run_on_rank, 2) == [single, single]


# ---- command line and training --------------------------------------------------------------------

def _cli(*args):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import eval_base
    finally:
        sys.path.pop(0)
    return eval_base.main(list(args))


def test_cli_errors_name_the_value(tmp_path, capsys):
    assert _cli("--load", str(tmp_path / "nope")) == 2
    assert f"--load {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    assert _cli("--load", str(tmp_path / "junk")) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    assert _cli("--load", str(tmp_path), "--evals", "codebase-ppl,vibes") == 2
    err = capsys.readouterr().err
    assert "unknown eval 'vibes'" in err and "state-tracking" in err
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    (tmp_path / "empty").mkdir()
    assert _cli("--load", str(ckpt), "--data", str(tmp_path / "empty")) == 2
    assert f"--data {tmp_path / 'empty'} has no UTF-8 files ending in .py" in capsys.readouterr().err


def test_pretrain_refuses_base_evals_on_sharded_weights():
    from megatron_composer.training.arguments import parse_args

    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 does not allow it"):
        parse_args(["--eval-base-interval", "2", "--expert-model-parallel-size", "2"])
    with pytest.raises(ValueError, match="unknown eval 'ppl'"):
        parse_args(["--eval-base-interval", "2", "--eval-base-evals", "ppl"])


def _tensorboard_scalars(directory) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_cpt_run_logs_base_evals_and_the_cli_evaluates_its_checkpoint(data_dir, tmp_path, capsys):
    import os

    from megatron_composer.convert import mcore_to_hf

    cmd = [sys.executable, str(REPO / "pretrain_cpt.py"), "--seq-length", "128", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--train-iters", "2", "--lr-warmup-iters", "1", "--data-cache-dir",
           str(data_dir), "--eval-base-interval", "2", "--eval-base-samples", "2",
           "--tensorboard-dir", str(tmp_path / "tb"), "--save", str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert " base evals at iteration 2 | codebase-nll-per-token: " in out.stdout
    logged = _tensorboard_scalars(tmp_path / "tb")
    for tag in ("base-eval/codebase-nll-per-token", "base-eval/state-tracking-edit-distance",
                "base-eval/knowledge-accuracy"):
        assert [step for step, _ in logged[tag]] == [2], tag
    assert 5 < logged["base-eval/codebase-nll-per-token"][0][1] < 10  # about ln 4096 after 2 steps

    # the checkpoint carries the tokenizer it was trained with, and so does its export
    from megatron_composer.data import default_cpt_data

    trained_with = Path(default_cpt_data(data_dir, progress=False).tokenizer_model).read_bytes()
    assert (tmp_path / "ckpt" / "tokenizer.model").read_bytes() == trained_with

    # the saved checkpoint, and the same weights exported to Hugging Face's layout, evaluate alike
    mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == trained_with
    rows = {}
    for name in ("ckpt", "hf"):
        # --seq-length: a Hugging Face config knows no training sequence length (its default is 4096)
        assert _cli("--load", str(tmp_path / name), "--samples", "2", "--data-cache-dir", str(data_dir),
                    "--seq-length", "128", "--out", str(tmp_path / f"{name}.json")) == 0
        table = capsys.readouterr().out
        assert table.startswith("| checkpoint | codebase NLL / token") and str(tmp_path / name) in table
        rows[name] = json.loads((tmp_path / f"{name}.json").read_text())["rows"][0]
    report = json.loads((tmp_path / "ckpt.json").read_text())
    assert report["config"]["window"] == 128 and report["config"]["stride"] == 64
    assert rows["ckpt"]["kind"] == "megatron-composer" and rows["hf"]["kind"] == "hugging-face"
    assert rows["ckpt"]["tokenizer"] == str(tmp_path / "ckpt" / "tokenizer.model")  # no --tokenizer-model given
    assert rows["hf"]["tokenizer"] == str(tmp_path / "hf" / "tokenizer.model")
    assert rows["ckpt"]["results"] == rows["hf"]["results"]
    ppl = rows["ckpt"]["results"]["codebase-ppl"]
    assert ppl["windows"] == 2 and ppl["tokens"] == 127 + 64
    # training evaluated the same items with the same weights
    for tag, value in scalars(rows["ckpt"]["results"]).items():
        assert value == pytest.approx(logged[tag][0][1], rel=1e-5, abs=1e-6), tag


def test_hugging_face_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_composer.eval.loading import resolve_tokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1]}))
    hf = resolve_tokenizer(None, str(tmp_path / "unused"), load=str(tmp_path))
    text = "def g(y):\n    return y\n"
    assert hf.eod == 1 and hf.vocab_size == tok.get_vocab_size()
    assert hf.decode(hf.encode(text)) == text and hf.decode(hf.encode(text) + [hf.eod]) == text
