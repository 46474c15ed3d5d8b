"""The Trainer: split invariance, CP / HSDP equivalence, bf16 main weights, the NaN guard.

Every comparison is against an independent configuration of the same
global batch (one rank, one micro-batch size) or an external reference
(`torch.optim.AdamW` on fp32 copies), never against the code under test.
"""
import math

import numpy as np
import pytest
import torch

from megatron_composer.data import sample_dict
from tests.distributed import run_distributed
from tests.trainers import make_trainer

SEQ = 64


class UnevenDataset(torch.utils.data.Dataset):
    """Random tokens with documents of random lengths and loss masks that keep
    a different fraction of every sample (some rows almost empty)."""

    def __init__(self, n=16, seq=SEQ, vocab=4096, seed=0, multiple=1):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            ids = torch.randint(3, vocab, (seq + 1,), generator=g)
            cuts = sorted({int(c) // multiple * multiple for c in torch.randint(4, seq - 4, (2,), generator=g)})
            cu = np.array([0, *[c for c in cuts if 0 < c < seq], seq], dtype=np.int32)
            keep = 0.05 + 0.9 * (i % 5) / 4
            mask = (torch.rand(seq, generator=g) < keep).float()
            self.rows.append(sample_dict(ids[:-1], ids[1:], mask, cu))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _step_summary(tr, steps=1):
    """Losses and grad norms of `steps` steps, the reduced gradients of the
    first one (dense parameters, gathered if sharded) just before the update,
    and the expert biases after the steps (aux-loss-free balancing counts only
    real tokens, so they match exactly however the batch was split or padded).

    Gradients, not updated weights, are compared: AdamW's first update is
    about lr * sign(g), which turns rounding noise in near-zero gradients into
    lr-sized weight differences."""
    grads = {}
    step = tr.optimizer.step
    names = tr.optimizer.names

    def capture():
        for name, g in zip(names, tr.model.grads() if not grads else ()):
            if g is not None and ".experts." not in name:
                grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return step()

    tr.optimizer.step = capture
    out = []
    for _ in range(steps):
        r = tr.step()
        out.append((r.lm_loss, r.mtp_loss, r.grad_norm))
    biases = {n: b.detach().clone() for n, b in tr.model.gpt.named_buffers() if n.endswith("expert_bias")}
    return out, grads, biases


def _assert_same(a, b, rel=1e-5):
    (steps_a, grads_a, biases_a), (steps_b, grads_b, biases_b) = a, b
    assert biases_a.keys() == biases_b.keys() and len(biases_a) >= 2  # decoder and MTP routers
    for name in biases_a:
        torch.testing.assert_close(biases_a[name], biases_b[name], rtol=0, atol=0, msg=name)
    for (la, ma, ga), (lb, mb, gb) in zip(steps_a, steps_b):
        assert la == pytest.approx(lb, rel=rel) and ma == pytest.approx(mb, rel=rel * 10)
        assert ga == pytest.approx(gb, rel=rel * 10)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        scale = grads_b[name].abs().max().item()
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-3, atol=1e-5 * scale + 1e-12,
                                   msg=name)


# ------------------------------------------------------------- split invariance
def _uneven(rank, world, micro_batch_size, **kw):
    tr = make_trainer(UnevenDataset(), micro_batch_size=micro_batch_size, global_batch_size=4, **kw)
    return _step_summary(tr)


def test_micro_batch_and_dp_split_do_not_change_loss_or_gradients():
    """Uneven loss masks: micro-batch 1 vs 4 on one rank, and DP=2 x micro-batch 2,
    at the same global batch of 4, give the same losses, grad norms and weights."""
    mb4 = _uneven(0, 1, 4)
    mb1 = _uneven(0, 1, 1)
    dp2 = run_distributed(_uneven, 2, 2)
    assert mb4[0][0][0] > 7.0  # a real loss at init (~ln 4096)
    _assert_same(mb1, mb4)
    _assert_same(dp2[0], mb4)


# ------------------------------------------------------------- CP = 2 and HSDP
def _cp_packed(rank, world, cp, sharding="ddp"):
    tr = make_trainer(UnevenDataset(seed=3), cp=cp, micro_batch_size=2, global_batch_size=2,
                      reset_attention_mask=True, pad_to_multiple=True, data_parallel_sharding=sharding,
                      dense_shard_size=2 if sharding == "hsdp" else None)
    return _step_summary(tr)


def test_cp2_packed_padded_step_equals_cp1():
    """A Trainer step at CP=2 on packed documents of odd lengths (--reset-attention-mask,
    --pad-to-multiple) equals CP=1, and so does HSDP with CP=2 (dense weights sharded over the CP ranks)."""
    cp1 = _cp_packed(0, 1, 1)
    cp2 = run_distributed(_cp_packed, 2, 2)
    _assert_same(cp2[0], cp1, rel=1e-5)
    hsdp = run_distributed(_cp_packed, 2, 2, "hsdp")
    _assert_same(hsdp[0], cp1, rel=1e-5)


# ------------------------------------------------------------- bf16 main weights
def test_bf16_main_weights_are_fp32_adamw_on_the_bf16_weights():
    """One --bf16 step: the fp32 main weights equal torch's AdamW run on fp32 copies
    of the bf16 weights with the fp32 gradients (an external reference), the model
    holds them rounded to bf16, and a pure-bf16 AdamW update would differ."""
    tr = make_trainer(UnevenDataset(), bf16=True, clip_grad=0.0, lr_warmup_iters=0)
    opt = tr.optimizer
    assert opt.mixed_precision
    assert all(p.dtype == torch.bfloat16 for p in tr.model.params)
    assert all(p.dtype == torch.float32 for p in opt.opt_params)
    before = [p.detach().clone() for p in tr.model.params]
    grads = {}
    original_step = opt.optimizers[0].step

    def capture(*a, **k):
        for p in opt.opt_params:
            grads[id(p)] = None if p.grad is None else p.grad.clone()
        return original_step(*a, **k)

    opt.optimizers[0].step = capture
    tr.step()
    lr = opt.param_groups[0]["lr"]
    ref_params, bf16_params = [], []
    for p0, main in zip(before, opt.opt_params):
        ref = torch.nn.Parameter(p0.float())
        ref.grad = grads[id(main)]
        ref_params.append(ref)
        low = torch.nn.Parameter(p0.clone())
        low.grad = None if ref.grad is None else ref.grad.bfloat16()
        bf16_params.append(low)
    decay = {i for i, p in enumerate(ref_params) if p.ndim >= 2}  # no bias in the model
    for ps in (ref_params, bf16_params):
        groups = [{"params": [ps[i] for i in decay], "weight_decay": 0.1},
                  {"params": [p for i, p in enumerate(ps) if i not in decay], "weight_decay": 0.0}]
        torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8).step()
    differs = 0
    for main, model_p, ref, low in zip(opt.opt_params, tr.model.params, ref_params, bf16_params):
        torch.testing.assert_close(main.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(model_p.detach(), main.detach().bfloat16())
        differs += int(not torch.equal(main.detach(), low.detach().float()))
    assert differs >= len(ref_params) // 2, differs  # fp32 main weights keep what bf16 rounds away


def test_bf16_tracks_fp32_loss_for_30_steps(tiny_cpt_losses):
    fp32, bf16 = tiny_cpt_losses(bf16=False), tiny_cpt_losses(bf16=True)
    assert sum(fp32[-3:]) / 3 < fp32[0] - 1.0  # it trained
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * a, (fp32, bf16)
    assert fp32 != bf16  # bf16 compute really ran


def _hsdp_bf16(rank, world):
    tr = make_trainer(UnevenDataset(), bf16=True, data_parallel_sharding="hsdp", dense_shard_size=2,
                      micro_batch_size=1)
    assert all(p.dtype == torch.float32 for p in tr.model.params)  # fp32 shards are the main weights
    assert not tr.optimizer.mixed_precision
    return [tr.step().lm_loss for _ in range(3)]


def test_bf16_under_hsdp_casts_fp32_shards():
    fp32 = [make_trainer(UnevenDataset(), micro_batch_size=2).step().lm_loss]
    bf16 = run_distributed(_hsdp_bf16, 2)
    assert bf16[0] == bf16[1]
    assert bf16[0][0] != fp32[0] and abs(bf16[0][0] - fp32[0]) < 0.02 * fp32[0]


# ------------------------------------------------------------- the NaN guard
def _biases(tr):
    return [m.expert_bias.clone() for m in tr.model.gpt.modules() if getattr(m, "expert_bias", None) is not None]


def _weights(tr):
    return [p.detach().clone() for p in tr.model.params]


class _PoisonLoss:
    """A loss plug-in whose sum is `value` (NaN / Inf) on the iterations listed."""

    name, scale = "poison", 1.0

    def __init__(self, tr, value, iterations):
        self.tr, self.value, self.iterations = tr, value, set(iterations)

    def count(self, batch, shift):
        return torch.ones(())

    def loss_sum(self, batch, out, shift):
        hit = self.tr.state.iteration in self.iterations
        return out.logits.sum() * (self.value if hit else 0.0)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_loss_skips_the_step_and_moves_no_expert_bias(value):
    tr = make_trainer(UnevenDataset(), max_skipped_iterations=3)
    tr.loss_plugins.append(_PoisonLoss(tr, value, {1}))
    first = tr.step()
    assert not first.skipped
    weights, biases = _weights(tr), _biases(tr)
    assert biases and any(b.abs().sum() > 0 for b in biases)  # the applied step moved the biases
    bad = tr.step()
    assert bad.skipped and not math.isfinite(bad.grad_norm)
    for a, b in zip(weights, _weights(tr)):
        assert torch.equal(a, b)
    for a, b in zip(biases, _biases(tr)):
        assert torch.equal(a, b)
    assert tr.state.skipped_iterations == 1 and tr.state.iteration == 2
    good = tr.step()
    assert not good.skipped and tr.state.consecutive_skipped == 0
    assert any(not torch.equal(a, b) for a, b in zip(biases, _biases(tr)))


def test_non_finite_gradient_skips_the_step():
    tr = make_trainer(UnevenDataset())
    weights = _weights(tr)
    victim = tr.model.params[3]
    handle = victim.register_hook(lambda g: g * math.inf)
    assert tr.step().skipped
    handle.remove()
    for a, b in zip(weights, _weights(tr)):
        assert torch.equal(a, b)
    assert not tr.step().skipped


def test_consecutive_skips_stop_the_run():
    from megatron_composer.training.trainer import TrainingAborted

    tr = make_trainer(UnevenDataset(), max_skipped_iterations=2, train_iters=10)
    tr.loss_plugins.append(_PoisonLoss(tr, math.nan, range(1, 10)))
    with pytest.raises(TrainingAborted, match="2 consecutive iterations skipped.*--max-skipped-iterations"):
        tr.train()
    assert tr.state.iteration == 3 and tr.state.skipped_iterations == 2


def test_non_finite_update_stops_the_run_before_any_save(tmp_path):
    """--adam-eps 0: embedding rows of tokens absent from the batch have zero
    gradients, so AdamW's update is 0/0 = NaN there."""
    from megatron_composer.optim.builder import NonFiniteParametersError

    tr = make_trainer(UnevenDataset(n=4), adam_eps=0.0, train_iters=4,
                      checkpoint={"save": str(tmp_path / "ckpt"), "save_interval": 1})
    with pytest.raises(NonFiniteParametersError, match="embedding.*--adam-eps 0.0"):
        tr.train()
    assert not list((tmp_path / "ckpt").glob("iter_*"))


def test_nan_activation_with_nvfp4_experts_skips_the_step():
    """A NaN reaching the quantized experts becomes a skipped step, not a crash."""
    from megatron_composer.config import MoEPrecisionConfig

    tr = make_trainer(UnevenDataset(), moe_precision=MoEPrecisionConfig(moe_expert_precision="nvfp4"))
    poison = {"on": True}

    def hook(module, args, output):
        if poison["on"]:
            output = output.clone()
            output[3, 0, :] = math.nan
        return output

    handle = tr.model.gpt.embedding.register_forward_hook(hook)
    weights = _weights(tr)
    assert tr.step().skipped
    for a, b in zip(weights, _weights(tr)):
        assert torch.equal(a, b)
    poison["on"] = False
    assert not tr.step().skipped
    handle.remove()


def test_bf16_resume_restores_the_fp32_main_weights(tmp_path):
    """--bf16 checkpoints carry the fp32 main weights: 2 steps, save, a new Trainer
    resumes and its 2 steps equal the uninterrupted run's steps 3 and 4 exactly."""
    ckpt = {"save": str(tmp_path), "load": str(tmp_path)}
    full = make_trainer(UnevenDataset(), bf16=True)
    reference = [full.step().lm_loss for _ in range(4)]
    first = make_trainer(UnevenDataset(), bf16=True, checkpoint=ckpt)
    losses = [first.step().lm_loss for _ in range(2)]
    first.checkpoints.save()
    resumed = make_trainer(UnevenDataset(), bf16=True, checkpoint=ckpt)
    resumed.resume()
    assert resumed.state.iteration == 2
    for main, ref in zip(resumed.optimizer.opt_params, first.optimizer.opt_params):
        assert main.dtype == torch.float32 and torch.equal(main, ref)
    losses += [resumed.step().lm_loss for _ in range(2)]
    assert losses == reference
