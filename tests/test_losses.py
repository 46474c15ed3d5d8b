"""Fused losses against straightforward references: values and gradients (fp32, 1e-6 relative).

References are written here from torch.nn.functional (kl_div, cross_entropy)
over explicitly built masks; the chunked code must match them for any chunk
size, both logits memory layouts, masks, packed documents and MTP depths 1, 2.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_composer.parallel import shift_left
from megatron_composer.training import losses
from megatron_composer.training.losses import lm_loss, mtp_cross_entropy_loss, mtp_self_distillation_loss

RTOL = 1e-6


def _close(actual, expected, name="", rtol=RTOL):
    err = (actual.double() - expected.double()).norm().item()
    assert err <= rtol * expected.double().norm().item(), f"{name}: |diff| {err:.3g} of {expected.norm():.3g}"


def _valid_by_hand(loss_mask, segment_ids, depth):
    """1 where position t has a counted label at t + depth in the same document."""
    b, s = loss_mask.shape
    valid = torch.zeros(b, s)
    for i in range(b):
        for t in range(s - depth):
            if segment_ids[i, t] == segment_ids[i, t + depth]:
                valid[i, t] = loss_mask[i, t + depth]
    return valid


def _reference_distillation(student, main, loss_mask, segment_ids, depth):
    s = student.shape[1]
    valid = _valid_by_hand(loss_mask, segment_ids, depth)[:, : s - depth]
    log_q = student[:, : s - depth].log_softmax(-1)
    log_p = main.detach()[:, depth:].log_softmax(-1)
    kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    return (kl * valid).sum(), valid.sum()


def _inputs(layout, b=3, s=23, v=50, seed=0):
    """(student, main) [b, s, v] leaf logits in `layout`, loss mask, packed document ids."""
    g = torch.Generator().manual_seed(seed)

    def logits():
        x = torch.randn(s, b, v, generator=g) * 3
        return (x.transpose(0, 1) if layout == "sbv" else x.transpose(0, 1).contiguous()).requires_grad_()

    student, main = logits(), logits()
    loss_mask = (torch.rand(b, s, generator=g) > 0.25).float()
    boundaries = torch.rand(b, s, generator=g) < 0.15
    segment_ids = boundaries.long().cumsum(1)
    return student, main, loss_mask, segment_ids


@pytest.fixture(params=[40, 1 << 17], ids=["chunk-one-position", "chunk-default"])
def chunk_elements(request, monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", request.param)


@pytest.mark.parametrize("layout", ["sbv", "bsv"])
@pytest.mark.parametrize("depth", [1, 2])
def test_self_distillation_equals_kl_div(chunk_elements, layout, depth):
    student, main, loss_mask, segment_ids = _inputs(layout)
    total, count = mtp_self_distillation_loss(student, main, loss_mask, depth, segment_ids)
    ref, ref_count = _reference_distillation(student, main, loss_mask, segment_ids, depth)
    assert count == ref_count and 0 < count < loss_mask.numel()
    _close(total, ref, "loss")
    upstream = 0.37  # as the loop's mtp_scale / n_mtp
    grad, = torch.autograd.grad(total * upstream, student)
    ref_grad, = torch.autograd.grad(ref * upstream, student)
    _close(grad, ref_grad, "student gradient")
    assert grad.stride() == student.stride()  # no layout change on the way back
    assert main.grad is None


def test_self_distillation_through_another_shift_equals_the_in_place_one():
    """A shift other than shift_left (the CP path) builds the shifted teacher; same result."""
    student, main, loss_mask, segment_ids = _inputs("sbv", seed=4)
    calls = []

    def other_shift(x, depth, fill):
        calls.append(x.shape)
        return shift_left(x, depth, fill)

    total, count = mtp_self_distillation_loss(student, main, loss_mask, 2, segment_ids, other_shift)
    ref, ref_count = _reference_distillation(student, main, loss_mask, segment_ids, 2)
    assert count == ref_count and main.shape in calls
    _close(total, ref, "loss")
    grad, = torch.autograd.grad(total, student)
    ref_grad, = torch.autograd.grad(ref, student)
    _close(grad, ref_grad, "student gradient")


def test_self_distillation_tiny_case_by_hand():
    # teacher at t+1: logits (0, ln 3) -> p = (1/4, 3/4); student at t: (0, 0) -> q = (1/2, 1/2)
    main = torch.tensor([[[5.0, -1.0], [0.0, math.log(3.0)]]])
    student = torch.zeros(1, 2, 2, requires_grad=True)
    total, count = mtp_self_distillation_loss(student, main, torch.ones(1, 2), 1)
    assert count == 1
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert abs(total.item() - expected) < 1e-7
    (2 * total).backward()
    # d KL / d student = q - p at t = 0; position 1 has no target
    torch.testing.assert_close(student.grad, torch.tensor([[[0.5, -0.5], [0.0, 0.0]]]), rtol=0, atol=1e-6)


def test_self_distillation_of_a_matching_student_is_zero():
    student, main, loss_mask, segment_ids = _inputs("bsv", seed=2)
    matching = shift_left(main.detach(), 1, 0.0).requires_grad_()
    total, _ = mtp_self_distillation_loss(matching, main, loss_mask, 1, segment_ids)
    assert total.abs() < 1e-5
    grad, = torch.autograd.grad(total, matching)
    assert grad.abs().max() < 1e-6


@pytest.mark.parametrize("layout", ["sbv", "bsv"])
def test_lm_loss_equals_cross_entropy(chunk_elements, layout):
    logits, _, loss_mask, _ = _inputs(layout, seed=1)
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, logits.shape[-1], loss_mask.shape, generator=g)
    labels[0, 3] = -100  # ignored, as F.cross_entropy ignores it
    total, count = lm_loss(logits, labels, loss_mask)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ref = (per_token * loss_mask.reshape(-1)).sum()
    assert count == loss_mask.sum()
    _close(total, ref, "loss")
    grad, = torch.autograd.grad(total * 0.5, logits)
    ref_grad, = torch.autograd.grad(ref * 0.5, logits)
    _close(grad, ref_grad, "gradient")
    assert grad[0, 3].abs().max() == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_cross_entropy_equals_cross_entropy_ahead(chunk_elements, depth):
    logits, _, loss_mask, segment_ids = _inputs("sbv", seed=3)
    labels = torch.randint(0, logits.shape[-1], loss_mask.shape, generator=torch.Generator().manual_seed(6))
    total, count = mtp_cross_entropy_loss(logits, labels, loss_mask, depth, segment_ids)
    s = logits.shape[1]
    valid = _valid_by_hand(loss_mask, segment_ids, depth)[:, : s - depth]
    per_token = F.cross_entropy(logits[:, : s - depth].reshape(-1, logits.shape[-1]),
                                labels[:, depth:].reshape(-1), reduction="none")
    ref = (per_token * valid.reshape(-1)).sum()
    assert count == valid.sum()
    _close(total, ref, "loss")
    grad, = torch.autograd.grad(total, logits)
    ref_grad, = torch.autograd.grad(ref, logits)
    _close(grad, ref_grad, "gradient")


def test_no_gradient_work_under_no_grad_and_one_backward_only():
    student, main, loss_mask, segment_ids = _inputs("sbv")
    with torch.no_grad():
        total, _ = mtp_self_distillation_loss(student, main, loss_mask, 1, segment_ids)
    assert not total.requires_grad
    total, _ = mtp_self_distillation_loss(student, main, loss_mask, 1, segment_ids)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph is not supported"):
        total.backward()
