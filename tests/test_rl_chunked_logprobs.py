"""The RL losses' vocabulary-sized work in chunks of positions, against references written here.

The references take torch.log_softmax of the whole fp32 logits (bf16 logits: of
the same values upcast) and differentiate with autograd: the policy
log-probs at the sampling temperature, the entropy metric, every registered
policy loss with TIS and the KL in the loss, and the feedback KL (both
directions, full vocabulary and top-k). fp32: entropy bitwise (the same
operations row by row), log-probs, losses and gradients within 1e-6 relative;
bf16: gradients (kept in bf16) within bf16 rounding. The largest fp32 tensor
the losses allocate is one chunk, never [T, V] (a CPU memory proxy).
"""
from types import SimpleNamespace

import pytest
import torch

from megatron_composer.inference.sampling import token_logprobs
from megatron_composer.parallel import shift_left
from megatron_composer.rl.algorithms import policy_gradient_loss
from megatron_composer.rl.config import RLConfig
from megatron_composer.rl.feedback_loss import FeedbackLoss, FeedbackTable, feedback_kl, feedback_kl_sum, teacher_rows
from megatron_composer.rl.loss import PolicyLoss
from megatron_composer.rl.policy_losses import POLICY_LOSSES
from megatron_composer.training import losses
from megatron_composer.training.loss_plugins import ModelOutput, MTPLoss
from megatron_composer.training.losses import token_log_probs
from tests.memory import LargestAllocation

RTOL = 1e-6
BF16_RTOL = 1e-2  # a few bf16 roundings (2**-8 relative each) of each gradient entry


def _close(actual, expected, name="", rtol=RTOL):
    err = (actual.double() - expected.double()).norm().item()
    assert err <= rtol * expected.double().norm().item(), f"{name}: |diff| {err:.3g} of {expected.norm():.3g}"


def _base(t, v, seed, dtype=torch.float32):
    """Leaf logits [1, t, v] stored as megatron's [t, 1, v]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 1, v, generator=g) * 3).to(dtype).transpose(0, 1).requires_grad_()


def _reference_logp(base, labels, temperature):
    """(fp32 leaf, log-probs [T], entropy [T]) from log_softmax of the whole upcast logits."""
    z = base.detach().float().requires_grad_()
    log_probs = torch.log_softmax(z[0] / temperature, dim=-1)
    logp = log_probs.gather(-1, labels[0, :, None])[:, 0]
    return z, logp, -(log_probs.exp() * log_probs).sum(-1)


@pytest.fixture(params=[40 * 1 * 7, 1 << 17], ids=["chunk-seven-positions", "chunk-default"])
def chunk_elements(request, monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", request.param)


# ---- the log-probs and the entropy --------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_and_entropy_equal_log_softmax(chunk_elements, temperature):
    t, v = 37, 40
    base = _base(t, v, seed=1)
    labels = torch.randint(0, v, (1, t), generator=torch.Generator().manual_seed(2))
    logp, entropy = token_log_probs(base, labels, temperature, entropy=True)
    z, ref_logp, ref_entropy = _reference_logp(base, labels, temperature)
    assert torch.equal(entropy[0], ref_entropy.detach()) and not entropy.requires_grad
    _close(logp[0], ref_logp, "log-probs")
    upstream = torch.randn(1, t, generator=torch.Generator().manual_seed(3))
    grad, = torch.autograd.grad(logp, base, upstream)
    ref_grad, = torch.autograd.grad(ref_logp, z, upstream[0])
    _close(grad, ref_grad, "gradient")
    assert grad.stride() == base.stride()
    # the sampler's helper is the same function on [n, V] rows; temperature 0 (greedy) reports T = 1
    torch.testing.assert_close(token_logprobs(base[0].detach(), labels[0], temperature), logp[0].detach(),
                               rtol=0, atol=0)
    torch.testing.assert_close(token_logprobs(base[0].detach(), labels[0], 0.0),
                               token_log_probs(base.detach(), labels)[0], rtol=0, atol=0)


def test_bf16_logits_against_the_same_values_upcast(chunk_elements):
    t, v = 29, 40
    base = _base(t, v, seed=4, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (1, t), generator=torch.Generator().manual_seed(5))
    logp, entropy = token_log_probs(base, labels, 0.7, entropy=True)
    z, ref_logp, ref_entropy = _reference_logp(base, labels, 0.7)
    assert torch.equal(entropy[0], ref_entropy.detach())
    _close(logp[0], ref_logp, "log-probs")  # fp32 math on the same upcast values
    upstream = torch.randn(1, t, generator=torch.Generator().manual_seed(6))
    grad, = torch.autograd.grad(logp, base, upstream)
    ref_grad, = torch.autograd.grad(ref_logp, z, upstream[0])
    assert grad.dtype == torch.bfloat16
    _close(grad, ref_grad, "bf16 gradient", BF16_RTOL)


def test_a_temperature_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="temperature 0.0 must be a finite number > 0"):
        token_log_probs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)


# ---- the policy loss plug-in, every registered loss ---------------------------------------------

T, V = 45, 40
CASES = [  # (flag-named settings, whether the batch carries old log-probs)
    (dict(policy_loss="dr_grpo"), False),
    (dict(policy_loss="dr_grpo", tis_cap=None), False),
    (dict(policy_loss="dr_grpo", kl_coef=0.1, kl_placement="loss", kl_kind="k1"), False),
    (dict(policy_loss="dr_grpo", kl_coef=0.1, kl_placement="loss", kl_kind="k2", tis_cap=None), False),
    (dict(policy_loss="ppo_clip", ppo_mini_batches=2, clip_eps_low=0.1, clip_eps_high=0.3), True),
    (dict(policy_loss="ppo_clip", ppo_mini_batches=2, clip_eps_low=0.2, tis_cap=None, kl_coef=0.05,
          kl_placement="loss", kl_kind="k3"), True),
    (dict(policy_loss="decoupled_ppo", clip_eps_low=0.2), False),
    (dict(policy_loss="decoupled_ppo", clip_eps_low=0.2, tis_cap=1.5), True),
]


def test_the_cases_cover_every_registered_policy_loss():
    assert {case["policy_loss"] for case, _ in CASES} == set(POLICY_LOSSES)


def _rl_batch(base, temperature, with_old, seed=7):
    """A packed micro-batch's per-token tensors [1, T]; old / sampler / reference log-probs near the
    policy's, so that ratios clip, TIS weights cap and the KL is not zero."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (1, T), generator=g)
    _, logp, _ = _reference_logp(base, labels, temperature)
    near = lambda scale: (logp.detach() + scale * torch.randn(T, generator=g))[None]  # noqa: E731
    mask = (torch.rand(1, T, generator=g) > 0.3).float()
    advantages = torch.randn(1, T, generator=g)
    return SimpleNamespace(tokens=labels, labels=labels, loss_mask=mask, advantages=advantages,
                           sampler_logp=near(0.5), ref_logp=near(0.3), old_logp=near(0.3) if with_old else None,
                           normalizer_share=3.5)


def _reference_policy_loss(base, batch, rl):
    """(loss, fp32 logits gradient, metrics) of policy_gradient_loss on log_softmax of the whole logits."""
    alg, temperature = rl.algorithm, rl.rollout.temperature
    z, logp, entropy = _reference_logp(base, batch.labels, temperature)
    kl_coef = alg.kl_coef if alg.kl_placement == "loss" else 0.0
    loss, metrics = policy_gradient_loss(
        logp, batch.old_logp[0] if batch.old_logp is not None else logp.detach(), batch.advantages[0],
        batch.loss_mask[0], normalizer=1.0, clip_eps_low=alg.clip_eps_low, clip_eps_high=alg.clip_eps_high,
        sampler_logp=batch.sampler_logp[0] if alg.tis_cap is not None else None, tis_cap=alg.tis_cap,
        entropy=entropy, ref_logp=batch.ref_logp[0], kl_coef=kl_coef, kl_kind=alg.kl_kind,
        policy_loss=alg.policy_loss)
    (0.37 * loss).backward()  # 0.37: the loop's scale / count
    keep = batch.loss_mask[0].bool()
    metrics["logp mismatch mean"] = (logp.detach() - batch.sampler_logp[0])[keep].abs().mean()
    return loss.detach(), z.grad, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("settings,with_old", CASES,
                         ids=["-".join(f"{k}={v}" for k, v in case.items()) for case, _ in CASES])
def test_policy_loss_equals_the_unchunked_reference(chunk_elements, settings, with_old, dtype):
    rl = RLConfig.from_flat(temperature=0.8, **settings)
    base = _base(T, V, seed=11, dtype=dtype)
    batch = _rl_batch(base, 0.8, with_old)
    ref_loss, ref_grad, ref_metrics = _reference_policy_loss(base, batch, rl)
    plugin = PolicyLoss(rl)
    loss = plugin.loss_sum(batch, ModelOutput(base * 1.0, []), shift_left)  # not a leaf, as a layer's output
    grad, = torch.autograd.grad(0.37 * loss, base)
    _close(loss, ref_loss, "loss")
    _close(grad, ref_grad, "logits gradient", RTOL if dtype == torch.float32 else BF16_RTOL)
    stats = plugin.pop_stats()
    for key in ("entropy", "kl", "ratio_mean", "clip_fraction", "tis_weight_mean", "logp mismatch mean"):
        assert (key in stats) == (key in ref_metrics), key
        if key in stats:  # means of O(1) per-token values (the KL's cancel): within 1e-6 absolute
            assert abs(stats[key] - ref_metrics[key].item()) <= 1e-6, (key, stats[key], ref_metrics[key])
    if settings["policy_loss"] == "ppo_clip":
        assert 0 < stats["clip_fraction"] < 1  # the clip acted on some tokens and not on others


# ---- the feedback KL ----------------------------------------------------------------------------

def _teacher(n, v, topk, seed):
    return teacher_rows(torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 2, topk)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("topk", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feedback_kl_sum_equals_feedback_kl_on_all_rows(chunk_elements, direction, topk, dtype):
    n, v = 23, 40
    student = _base(n, v, seed=12, dtype=dtype)[0]  # [N, V]
    table_logp, index = _teacher(9, v, topk, seed=13)
    rows = torch.randint(0, 9, (n,), generator=torch.Generator().manual_seed(14))
    total = feedback_kl_sum(student, table_logp, index, direction, rows=rows)
    z = student.detach().float().requires_grad_()
    # the reference: the whole student log-softmax of every row, as the loss was before chunking
    log_s = torch.log_softmax(z, -1)
    if index is None:
        teacher, log_s_rows = table_logp[rows], log_s
    else:
        rest = torch.log1p(-log_s.gather(-1, index[rows]).exp().sum(-1, keepdim=True).clamp(max=1 - 1e-7))
        teacher, log_s_rows = table_logp[rows], torch.cat([log_s.gather(-1, index[rows]), rest], -1)
    p = (teacher if direction == "forward" else log_s_rows).exp()
    sign = 1.0 if direction == "forward" else -1.0
    ref = (p * sign * (teacher - log_s_rows)).sum()
    _close(total, ref, "feedback KL", RTOL if index is None else 1e-5)
    _close(total, feedback_kl(student.detach(), table_logp[rows], None if index is None else index[rows],
                              direction).sum(), "against feedback_kl")
    grad, = torch.autograd.grad(0.5 * total, student)
    ref_grad, = torch.autograd.grad(0.5 * ref, z)
    rtol = BF16_RTOL if dtype == torch.bfloat16 else (RTOL if index is None else 1e-5)
    _close(grad, ref_grad, "student gradient", rtol)


def test_feedback_kl_sum_under_no_grad_and_a_second_backward():
    student = _base(5, 40, seed=15)[0]
    table_logp, _ = _teacher(5, 40, 0, seed=16)
    with torch.no_grad():
        assert not feedback_kl_sum(student, table_logp).requires_grad
    total = feedback_kl_sum(student * 1.0, table_logp)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph is not supported"):
        total.backward()


def test_policy_feedback_and_mtp_losses_in_the_loops_order_equal_the_references(chunk_elements):
    """The RL trainer's plug-ins on one forward's logits: the policy loss writes its gradient over the
    main logits in backward, the feedback KL and the MTP self-distillation read them in forward."""
    rl = RLConfig.from_flat(temperature=0.8, kl_coef=0.1, kl_placement="loss")
    base, mtp_base = _base(T, V, seed=17), _base(T, V, seed=18)
    batch = _rl_batch(base, 0.8, False)
    batch.segment_ids = torch.zeros(1, T, dtype=torch.long)
    batch.feedback_rows = torch.full((1, T), -1)
    at = torch.tensor([4, 5, 6, 20, 21, 33])
    batch.feedback_rows[0, at] = torch.arange(len(at))
    table_logp, _ = _teacher(len(at), V, 0, seed=19)
    batch.feedback_table = FeedbackTable(table_logp)
    plugins = [PolicyLoss(rl), FeedbackLoss("reverse", scale=0.5), MTPLoss(1, scale=0.3)]
    out = ModelOutput(base * 1.0, [mtp_base * 1.0])
    sums = [p.loss_sum(batch, out, shift_left) for p in plugins]
    grads = torch.autograd.grad(sum(p.scale * s for p, s in zip(plugins, sums)), [base, mtp_base])

    _, ref_policy_grad, _ = _reference_policy_loss(base, batch, rl)  # scaled by 0.37: undo it
    z = base.detach().requires_grad_()
    ref_feedback = feedback_kl(z[0, at], table_logp, None, "reverse").sum()
    mtp = mtp_base.detach().requires_grad_()
    log_q, log_p = torch.log_softmax(mtp[0, :-1], -1), torch.log_softmax(base.detach()[0, 1:], -1)
    ref_mtp = (log_p.exp() * (log_p - log_q)).sum(-1).mul(batch.loss_mask[0, 1:]).sum()
    (0.5 * ref_feedback + 0.3 * ref_mtp).backward()
    _close(sums[1], ref_feedback, "feedback KL")
    _close(sums[2], ref_mtp, "MTP KL")
    _close(grads[0], ref_policy_grad / 0.37 + z.grad, "main logits gradient")
    _close(grads[1], mtp.grad, "MTP logits gradient")


# ---- memory -------------------------------------------------------------------------------------

def test_policy_and_feedback_losses_allocate_at_most_one_fp32_chunk(monkeypatch):
    """Forward and backward of the policy loss (TIS, KL in the loss, entropy) and the feedback KL over
    half the positions on bf16 logits, then the no-grad log-probs of the old / reference forwards.
    (With fp32 logits the gradients are fp32 [T, V] by nature: the logits' own dtype.)"""
    t, v, rows = 512, 256, 4
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", rows * v)
    rl = RLConfig.from_flat(temperature=0.8, kl_coef=0.1, kl_placement="loss")
    base = _base(t, v, seed=20, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(21)
    labels = torch.randint(0, v, (1, t), generator=g)
    batch = SimpleNamespace(tokens=labels, labels=labels, loss_mask=torch.ones(1, t), normalizer_share=1.0,
                            advantages=torch.randn(1, t, generator=g), sampler_logp=-torch.rand(1, t, generator=g),
                            ref_logp=-torch.rand(1, t, generator=g), old_logp=None,
                            feedback_rows=torch.where(torch.arange(t) % 2 == 0, torch.arange(t) // 2, -1)[None],
                            feedback_table=FeedbackTable(torch.log_softmax(torch.randn(t // 2, v, generator=g), -1)))
    with LargestAllocation(torch.float32) as mode:
        out = ModelOutput(base * 1.0, [])
        loss = PolicyLoss(rl).loss_sum(batch, out, shift_left) + FeedbackLoss().loss_sum(batch, out, shift_left)
        loss.backward()
        with torch.no_grad():
            token_logprobs(base[0], labels[0], 0.8)
    assert mode.ops > 100  # the mode saw forward and backward
    chunk_bytes, logits_fp32_bytes = rows * v * 4, t * v * 4
    assert mode.largest <= chunk_bytes < logits_fp32_bytes / 8, (mode.largest, chunk_bytes, logits_fp32_bytes)
