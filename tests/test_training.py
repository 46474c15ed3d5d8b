"""Training: pure pieces, CPT end to end, resume exactness, reshard, atomic checkpoints, bad input."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_composer.training.batches import micro_batch_indices, segment_ids_from_cu_seqlens
from megatron_composer.training.losses import (
    lm_loss,
    mtp_cross_entropy_loss,
    mtp_self_distillation_loss,
    mtp_valid_mask,
)
from megatron_composer.optim.schedule import learning_rate
from tests.distributed import run_distributed
from tests.trainers import pretrain_in_process

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- pure pieces
def test_learning_rate_schedule():
    assert learning_rate(0, 1.0, 0.1, 4, 10) == pytest.approx(0.25)
    assert learning_rate(3, 1.0, 0.1, 4, 10) == pytest.approx(1.0)
    # halfway through cosine decay: min + (max - min) / 2
    assert learning_rate(6, 1.0, 0.1, 4, 10) == pytest.approx(0.55)
    assert learning_rate(50, 1.0, 0.1, 4, 10) == pytest.approx(0.1)
    assert learning_rate(6, 1.0, 0.1, 4, 10, "linear") == pytest.approx(0.55)
    assert learning_rate(5, 1.0, 0.1, 4, 10, "linear") == pytest.approx(0.7)  # 1/3 of the decay
    assert learning_rate(8, 1.0, 0.1, 4, 10, "constant") == 1.0


def test_micro_batch_indices_cover_the_global_batch_once():
    seen = []
    for rank in range(2):
        rounds = micro_batch_indices(100, 8, 2, rank, 2)
        assert len(rounds) == 2
        seen += [i for r in rounds for i in r]
    assert sorted(seen) == list(range(100, 108))
    with pytest.raises(ValueError, match="not divisible by micro-batch-size x data-parallel size"):
        micro_batch_indices(0, 6, 4, 0, 1)


def test_segment_ids():
    ids = segment_ids_from_cu_seqlens(torch.tensor([0, 3, 5, 8]), 8)
    assert ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]


def test_lm_loss_is_masked_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 4, 7, generator=g), torch.randint(0, 7, (2, 4), generator=g)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1.0]])
    total, count = lm_loss(logits, labels, mask)
    ref = F.cross_entropy(logits[mask.bool()], labels[mask.bool()], reduction="sum")
    assert count == 6
    torch.testing.assert_close(total, ref)


def test_mtp_self_distillation_targets_the_main_head_one_step_ahead():
    g = torch.Generator().manual_seed(0)
    main = torch.randn(1, 5, 6, generator=g, requires_grad=True)
    mask = torch.ones(1, 5)
    # a student that equals the teacher shifted by one has zero loss
    student = torch.zeros(1, 5, 6)
    student[:, :4] = main[:, 1:].detach()
    total, count = mtp_self_distillation_loss(student, main, mask, 1)
    assert count == 4 and total.abs() < 1e-6
    # otherwise the loss is KL(teacher || student) by hand, and no gradient reaches the teacher
    student = torch.randn(1, 5, 6, generator=g, requires_grad=True)
    total, count = mtp_self_distillation_loss(student, main, mask, 1)
    p = main[0, 1:].softmax(-1)
    ref = (p * (p.log() - student[0, :4].log_softmax(-1))).sum()
    torch.testing.assert_close(total, ref)
    total.backward()
    assert main.grad is None and student.grad.abs().sum() > 0


def test_mtp_masks_respect_documents_and_labels():
    mask = torch.tensor([[1, 1, 1, 0, 1.0]])
    seg = torch.tensor([[0, 0, 1, 1, 1]])
    assert mtp_valid_mask(mask, 1, seg).tolist() == [[1, 0, 0, 1, 0]]
    logits, labels = torch.randn(1, 5, 4), torch.tensor([[1, 2, 3, 0, 1]])
    total, count = mtp_cross_entropy_loss(logits, labels, mask, 1, seg)
    ref = F.cross_entropy(logits[0, [0, 3]], labels[0, [1, 4]], reduction="sum")
    assert count == 2
    torch.testing.assert_close(total, ref)


# ---------------------------------------------------------------- end to end
def _run(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "pretrain_cpt.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _losses(stdout):
    return [float(line.split("lm loss: ")[1].split(" ")[0]) for line in stdout.splitlines() if "lm loss: " in line and "iteration" in line]


def test_cpt_end_to_end_loss_falls(data_dir, tmp_path):
    out = _run(["--data-cache-dir", str(data_dir), "--train-iters", "30", "--seq-length", "128",
                "--micro-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "3",
                "--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb")])
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(out.stdout)
    assert len(losses) == 30
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, losses  # from ~ln(4096) = 8.3 down by more than a nat
    assert "mtp loss" in out.stdout and "tokens/s" in out.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert any((tmp_path / "tb").iterdir())
    assert "validation loss" in out.stdout


def _trainer(dataset, ep=1, iters=8, optimizer="adam"):
    from tests.trainers import make_trainer

    return make_trainer(dataset, ep=ep, optimizer=optimizer, lr_decay_iters=iters)


def _dataset(prefix):
    from megatron_composer.data import CPTDataset

    return CPTDataset(prefix, 64, seed=5)


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_resume_reproduces_the_uninterrupted_run(data_dir, tmp_path, optimizer):
    from megatron_composer import checkpoint as ck

    ds = _dataset(str(data_dir / "stdlib_train"))
    full = _trainer(ds, optimizer=optimizer)
    ref = [full.step().lm_loss for _ in range(6)]
    ref_params = {k: v.clone() for k, v in ck.model_state_dict(full.model).items()}

    first = _trainer(ds, optimizer=optimizer)
    losses = [first.step().lm_loss for _ in range(3)]
    ck.save_checkpoint(str(tmp_path), 3, first.model, first.optimizer,
                       {"consumed_samples": first.state.consumed_samples})
    resumed = _trainer(ds, optimizer=optimizer)
    meta = ck.load_checkpoint(str(tmp_path), resumed.model, resumed.optimizer)
    resumed.load_state_dict(dict(meta, iteration=meta["iteration"]))
    losses += [resumed.step().lm_loss for _ in range(3)]
    assert losses == ref  # bit-exact on CPU
    for k, v in ck.model_state_dict(resumed.model).items():
        assert torch.equal(v, ref_params[k]), k


def _ep2_save(rank, world, prefix, path):
    from megatron_composer import checkpoint as ck
    from megatron_composer.models import composer_forward

    tr = _trainer(_dataset(prefix), ep=2)
    for _ in range(2):
        tr.step()
    ck.save_checkpoint(path, 2, tr.model, tr.optimizer, {"consumed_samples": tr.state.consumed_samples})
    tokens = torch.arange(64).reshape(1, 64) * 7 % 4096
    logits, _ = composer_forward(tr.model, tokens, torch.arange(64)[None])
    state = {k: v.clone() for k, v in ck.optimizer_state_dict(tr.model, tr.optimizer).items()}
    return logits.detach(), state


def test_checkpoint_saved_with_ep2_loads_with_ep1(data_dir, tmp_path):
    """Logits, and every optimizer state value per expert: the EP=1 run holds all
    8 experts, each with the moments the EP=2 rank that owned it saved."""
    from megatron_composer import checkpoint as ck
    from megatron_composer.models import composer_forward

    (logits0, state0), (logits1, state1) = run_distributed(_ep2_save, 2, str(data_dir / "stdlib_train"),
                                                           str(tmp_path))
    torch.testing.assert_close(logits0, logits1)
    tr = _trainer(_dataset(str(data_dir / "stdlib_train")), ep=1)
    ck.load_checkpoint(str(tmp_path), tr.model, tr.optimizer)
    tokens = torch.arange(64).reshape(1, 64) * 7 % 4096
    logits, _ = composer_forward(tr.model, tokens, torch.arange(64)[None])
    torch.testing.assert_close(logits.detach(), logits0, rtol=1e-5, atol=1e-5)
    loaded = ck.optimizer_state_dict(tr.model, tr.optimizer)
    expert_keys = [k for k in loaded if ".experts.local_experts." not in k and ".experts." in k]
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in expert_keys}
    assert experts == set(range(8)) and all(k.endswith(("/exp_avg", "/exp_avg_sq", "/step")) for k in expert_keys)
    for key, value in loaded.items():
        owners = [s[key] for s in (state0, state1) if key in s]
        assert owners, key  # every state entry was saved by some EP=2 rank
        if ".experts." in key:
            assert len(owners) == 1, key  # an expert lives on one EP rank
        assert torch.equal(value, owners[0]), key
    assert len(loaded) == len(set(state0) | set(state1))


def test_interrupted_save_keeps_the_previous_checkpoint(data_dir, tmp_path):
    from megatron_composer import checkpoint as ck

    tr = _trainer(_dataset(str(data_dir / "stdlib_train")))
    tr.step()
    ck.save_checkpoint(str(tmp_path), 1, tr.model, tr.optimizer, {"consumed_samples": 4})
    # a save of iteration 2 that died half-way: its .tmp dir exists, the tracker is untouched
    (tmp_path / "iter_0000002.tmp").mkdir()
    (tmp_path / "iter_0000002.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert ck.latest_iteration(str(tmp_path)) == 1
    assert ck.load_checkpoint(str(tmp_path), tr.model)["iteration"] == 1
    # the next save of iteration 2 clears the debris and completes
    ck.save_checkpoint(str(tmp_path), 2, tr.model, tr.optimizer, {"consumed_samples": 8})
    assert ck.latest_iteration(str(tmp_path)) == 2 and not (tmp_path / "iter_0000002.tmp").exists()


# ---------------------------------------------------------------- bad input
# The first starts the script; the others stop before the first step and call its main() in this process.
def test_unknown_preset_is_refused():
    out = _run(["--model-preset", "gpt-9"])
    assert out.returncode != 0 and "unknown --model-preset 'gpt-9'" in out.stderr


def test_sequence_longer_than_the_data(tmp_path, capsys):
    from megatron_composer.data.indexed import build_indexed_dataset
    from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer
    from megatron_composer.data.corpus import stdlib_corpus

    model = train_tokenizer(stdlib_corpus("valid")[:3], 400, tmp_path / "tok")
    build_indexed_dataset(["def f():\n    return 1\n"] * 3, Tokenizer(model), str(tmp_path / "small"), progress=False)
    out = pretrain_in_process(["--data-path", str(tmp_path / "small"), "--tokenizer-model", str(model),
                               "--seq-length", "512", "--train-iters", "1"], capsys)
    assert out.returncode != 0
    assert "--seq-length" in out.stderr and "512" in out.stderr


def test_missing_data_path(tmp_path, capsys):
    out = pretrain_in_process(["--data-path", str(tmp_path / "nope"), "--tokenizer-model", str(tmp_path / "nope.model")],
                              capsys)
    assert out.returncode != 0 and str(tmp_path / "nope") in out.stderr


def test_corrupt_index_is_named(data_dir, tmp_path, capsys):
    import shutil

    for ext in (".bin", ".idx"):
        shutil.copy(data_dir / f"stdlib_valid{ext}", tmp_path / f"bad{ext}")
    idx = tmp_path / "bad.idx"
    idx.write_bytes(idx.read_bytes()[:40])
    out = pretrain_in_process(["--data-path", str(tmp_path / "bad"), "--tokenizer-model",
                               str(data_dir / "tokenizer.model"), "--train-iters", "1"], capsys)
    assert out.returncode != 0 and "bad.idx" in out.stderr and "preprocess_data.py" in out.stderr


def test_mtp_added_to_a_checkpoint_trained_without_it(data_dir, tmp_path):
    """The recipe adds MTP mid-CPT: load trunk weights, MTP starts fresh, trunk frozen."""
    common = ["--data-cache-dir", str(data_dir), "--seq-length", "64", "--micro-batch-size", "2"]
    out = _run(common + ["--train-iters", "2", "--mtp-num-layers", "0", "--save", str(tmp_path / "a")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mtp loss" not in out.stdout
    out = _run(common + ["--train-iters", "2", "--mtp-num-layers", "1", "--mtp-freeze-trunk",
                         "--load", str(tmp_path / "a"), "--finetune", "--save", str(tmp_path / "b")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mtp loss" in out.stdout and "weights only" in out.stdout
    from megatron_composer import checkpoint as ck

    import torch.distributed.checkpoint as dcp

    def tensor(root, name):
        t = {f"model.{name}": torch.empty(0)}
        meta = dcp.FileSystemReader(ck.iteration_dir(root, 2)).read_metadata().state_dict_metadata
        t[f"model.{name}"] = torch.empty(meta[f"model.{name}"].size)
        dcp.load(t, checkpoint_id=ck.iteration_dir(root, 2))
        return t[f"model.{name}"]

    trunk = "decoder.layers.0.self_attention.linear_proj.weight"
    assert torch.equal(tensor(str(tmp_path / "a"), trunk), tensor(str(tmp_path / "b"), trunk))  # frozen
    assert tensor(str(tmp_path / "b"), "mtp.layers.0.eh_proj.weight").shape == (128, 256)


def test_losses_do_not_depend_on_the_logits_memory_layout():
    g = torch.Generator().manual_seed(3)
    sbv = torch.randn(6, 2, 9, generator=g)  # megatron's [s, b, v] storage
    labels, mask = torch.randint(0, 9, (2, 6), generator=g), (torch.rand(2, 6, generator=g) > 0.3).float()
    a = lm_loss(sbv.transpose(0, 1), labels, mask)
    b = lm_loss(sbv.transpose(0, 1).contiguous(), labels, mask)
    torch.testing.assert_close(a, b)
    a = mtp_cross_entropy_loss(sbv.transpose(0, 1), labels, mask, 1)
    b = mtp_cross_entropy_loss(sbv.transpose(0, 1).contiguous(), labels, mask, 1)
    torch.testing.assert_close(a, b)


def test_sft_stage_trains_on_assistant_tokens_only(data_dir, tmp_path):
    import shutil

    work = tmp_path / "data"
    shutil.copytree(data_dir, work)  # the SFT JSONL is built next to the cached CPT data
    out = _run(["--stage", "sft", "--data-cache-dir", str(work), "--train-iters", "3",
                "--seq-length", "128", "--micro-batch-size", "2", "--save", str(tmp_path / "sft")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "> stage sft" in out.stdout and len(_losses(out.stdout)) == 3
    from megatron_composer.data import SFTDataset
    from megatron_composer.data.tokenizer import Tokenizer

    tok = Tokenizer(work / "tokenizer.model")
    sample = SFTDataset(work / "stdlib_sft_train.jsonl", tok, 128)[0]
    trained = sample["labels"][sample["loss_mask"] > 0].tolist()
    assert trained and tok.chat["user"] not in trained  # loss only on assistant content and <|end|>
    assert 0 < sample["loss_mask"].sum() < 128


def test_256k_stage_runs_at_its_tiny_length(data_dir, tmp_path):
    out = _run(["--stage", "cpt-256k", "--data-cache-dir", str(data_dir), "--train-iters", "1",
                "--micro-batch-size", "1", "--eval-iters", "1"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "seq-length 4096" in out.stdout and "consumed tokens: 4096" in out.stdout
