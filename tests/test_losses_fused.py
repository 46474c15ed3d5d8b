"""Chunked losses with megatron-core's fused cross-entropy, logits overwritten by their
gradients, bf16 logits and a vocabulary split over ranks, against references written here
(F.cross_entropy, F.kl_div over explicitly built masks; fp32, 1e-6 relative), and the
largest tensor they allocate (a CPU memory proxy; the CUDA measurement is gpu-marked).
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_composer.training import losses
from megatron_composer.training.losses import lm_loss, mtp_cross_entropy_loss, mtp_self_distillation_loss
from tests.distributed import run_distributed
from tests.test_losses import RTOL, _close, _valid_by_hand  # the shared hand-written references
from tests.memory import LargestAllocation


def _sbv(b, s, v, g, dtype=torch.float32):
    """Leaf logits [b, s, v] stored as megatron's [s, b, v]."""
    return (torch.randn(s, b, v, generator=g) * 3).to(dtype).transpose(0, 1).requires_grad_()


def _batch(b=3, s=23, v=50, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    main, student = _sbv(b, s, v, g, dtype), _sbv(b, s, v, g, dtype)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, 3] = -100
    loss_mask = (torch.rand(b, s, generator=g) > 0.25).float()
    segment_ids = (torch.rand(b, s, generator=g) < 0.15).long().cumsum(1)
    return main, student, labels, loss_mask, segment_ids


def _reference(main, student, labels, loss_mask, segment_ids, depth, mtp):
    """lm CE + the MTP loss of `student` at `depth`, from torch.nn.functional on fp32 copies."""
    main, student = main.detach().float().requires_grad_(), student.detach().float().requires_grad_()
    b, s, v = main.shape
    ce = F.cross_entropy(main.reshape(-1, v), labels.reshape(-1), reduction="none")
    lm = (ce * loss_mask.reshape(-1)).sum()
    valid = _valid_by_hand(loss_mask, segment_ids, depth)[:, : s - depth]
    if mtp == "self-distill":
        log_q, log_p = student[:, : s - depth].log_softmax(-1), main.detach()[:, depth:].log_softmax(-1)
        per_position = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    else:
        per_position = F.cross_entropy(student[:, : s - depth].reshape(-1, v), labels[:, depth:].reshape(-1),
                                       reduction="none").view(b, s - depth)
    extra = (per_position * valid).sum()
    (0.5 * lm + 0.3 * extra).backward()
    return lm.detach(), extra.detach(), main.grad, student.grad


def _ours(main, student, labels, loss_mask, segment_ids, depth, mtp, **kernel):
    """As the loss plug-ins call them: LM loss first, then the MTP loss reading the main logits."""
    lm, _ = lm_loss(main, labels, loss_mask, **kernel)
    if mtp == "self-distill":
        kernel.pop("fusion", None)
        extra, _ = mtp_self_distillation_loss(student, main, loss_mask, depth, segment_ids, **kernel)
    else:
        extra, _ = mtp_cross_entropy_loss(student, labels, loss_mask, depth, segment_ids, **kernel)
    main_grad, student_grad = torch.autograd.grad(0.5 * lm + 0.3 * extra, [main, student])
    return lm.detach(), extra.detach(), main_grad, student_grad


@pytest.fixture(params=[50 * 3, 1 << 17], ids=["chunk-one-position", "chunk-default"])
def chunk_elements(request, monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", request.param)


@pytest.mark.parametrize("mtp", ["self-distill", "ce"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fusion", [False, True], ids=["torch", "megatron-fused"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-grad", "grad-in-logits"])
def test_losses_equal_the_references(chunk_elements, mtp, depth, fusion, overwrite):
    main, student, labels, loss_mask, segment_ids = _batch(seed=depth)
    ref = _reference(main, student, labels, loss_mask, segment_ids, depth, mtp)
    got = _ours(main, student, labels, loss_mask, segment_ids, depth, mtp, fusion=fusion,
                overwrite_logits=overwrite)
    for name, a, e in zip(["lm loss", "mtp loss", "main grad", "student grad"], got, ref):
        _close(a, e, name)
    assert got[2][0, 3].abs().max() == 0  # the ignored label
    if overwrite:  # the gradient *is* the logits' storage, in their layout
        assert got[2].data_ptr() == main.data_ptr() and got[3].data_ptr() == student.data_ptr()
    else:
        assert got[2].stride() == main.stride() and got[3].stride() == student.stride()


@pytest.mark.parametrize("fusion", [False, True], ids=["torch", "megatron-fused"])
def test_bf16_logits_within_bf16_tolerance(fusion):
    main, student, labels, loss_mask, segment_ids = _batch(v=300, seed=7, dtype=torch.bfloat16)
    ref = _reference(main, student, labels, loss_mask, segment_ids, 1, "self-distill")
    got = _ours(main, student, labels, loss_mask, segment_ids, 1, "self-distill", fusion=fusion,
                overwrite_logits=True)
    assert got[2].dtype == got[3].dtype == torch.bfloat16  # bf16 grads, as megatron's fused CE
    _close(got[0], ref[0], "lm loss")  # statistics in fp32 on exactly upcast logits
    _close(got[1], ref[1], "mtp loss", rtol=1e-5)
    _close(got[2], ref[2], "main grad", rtol=1e-2)  # rounded to bf16 once
    _close(got[3], ref[3], "student grad", rtol=1e-2)  # rounded in forward, scaled in backward


def test_megatron_statistics_leave_fp32_logits_untouched():
    """megatron's pieces subtract the max in place; they must work on a copy."""
    x = torch.randn(4, 2, 30)
    before = x.clone()
    labels = torch.randint(0, 30, (4, 2))
    loss, lse = losses.megatron_cross_entropy_statistics(x, labels, losses.VocabShard())
    assert torch.equal(x, before)
    _close(lse, torch.logsumexp(x, -1), "lse")
    _close(loss, F.cross_entropy(x.reshape(-1, 30), labels.reshape(-1), reduction="none").view(4, 2), "loss")


def _largest_allocation(monkeypatch, dtype, overwrite, mtp="self-distill"):
    b, s, v, rows = 2, 128, 512, 4
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", rows * b * v)
    main, student, labels, loss_mask, segment_ids = _batch(b, s, v, seed=3, dtype=dtype)
    with LargestAllocation() as mode:
        _ours(main, student, labels, loss_mask, segment_ids, 1, mtp, overwrite_logits=overwrite, fusion=True)
    assert mode.ops > 100  # the mode saw forward and backward
    return mode.largest, rows * b * v * 4, main.numel() * main.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mtp", ["self-distill", "ce"])
def test_grad_in_logits_allocates_at_most_one_fp32_chunk(monkeypatch, dtype, mtp):
    largest, chunk_bytes, logits_bytes = _largest_allocation(monkeypatch, dtype, True, mtp)
    assert largest <= chunk_bytes < logits_bytes / 8, (largest, chunk_bytes, logits_bytes)


def test_new_grad_allocates_one_logits_sized_gradient(monkeypatch):
    largest, chunk_bytes, logits_bytes = _largest_allocation(monkeypatch, torch.bfloat16, False)
    assert largest == logits_bytes


def test_behind_an_output_layer_the_losses_allocate_one_fp32_chunk_and_match(monkeypatch):
    """As in training: logits made by a projection (not leaves), one backward() of LM + MTP
    loss; the parameters' gradients equal the references', nothing logits-sized is allocated.
    (A *leaf* would cost one copy: AccumulateGrad clones a gradient that shares its storage.)"""
    s, b, h, v = 256, 2, 16, 256
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 4 * b * v)
    g = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(s, b, h, generator=g), torch.randn(v, h, generator=g)
    labels, loss_mask = torch.randint(0, v, (b, s), generator=g), torch.ones(b, s)
    segment_ids = torch.zeros(b, s, dtype=torch.long)

    def heads():
        w = weight.clone().requires_grad_()
        return w, (hidden @ w.t()).transpose(0, 1), (hidden.flip(0) @ w.t()).transpose(0, 1)

    w, main, student = heads()
    _, _, ref_main, ref_student = _reference(main, student, labels, loss_mask, segment_ids, 1, "self-distill")
    ref = torch.autograd.grad([main, student], w, [ref_main, ref_student])[0]
    w, main, student = heads()
    with LargestAllocation() as mode:
        lm, _ = lm_loss(main, labels, loss_mask, fusion=True, overwrite_logits=True)
        kl, _ = mtp_self_distillation_loss(student, main, loss_mask, 1, segment_ids, overwrite_logits=True)
        (0.5 * lm + 0.3 * kl).backward()
    _close(w.grad, ref, "output weight gradient")
    chunk_bytes, weight_grad_bytes = 4 * b * v * 4, weight.numel() * 4
    assert mode.largest <= max(chunk_bytes, weight_grad_bytes) < main.numel() * 4 / 8


def _vocab_parallel_body(rank, world_size, tensors):
    main, student, labels, loss_mask, segment_ids = tensors
    v = main.shape[-1] // world_size
    shard = slice(rank * v, (rank + 1) * v)
    losses.CHUNK_ELEMENTS = 3 * v  # several chunks, each all-reduced
    out = {}
    for fusion in (False, True):
        for mtp in ("self-distill", "ce"):  # fresh shards each time: the gradients overwrite them
            local = [x[..., shard].clone().requires_grad_() for x in (main, student)]
            out[fusion, mtp] = _ours(*local, labels, loss_mask, segment_ids, 2, mtp, fusion=fusion,
                                     overwrite_logits=True, group=torch.distributed.group.WORLD)
    return out


def test_vocab_split_over_two_ranks_equals_the_full_vocabulary():
    """Each of 2 gloo ranks holds half the vocabulary (torch and megatron-fused statistics)."""
    tensors = _batch(v=64, seed=5)
    results = run_distributed(_vocab_parallel_body, 2, [t.detach() for t in tensors])
    for (fusion, mtp) in results[0]:
        ref = _reference(*tensors, 2, mtp)
        for rank, out in enumerate(results):
            _close(out[fusion, mtp][0], ref[0], f"{fusion} {mtp} rank {rank} lm loss")
            _close(out[fusion, mtp][1], ref[1], f"{fusion} {mtp} rank {rank} mtp loss")
        for i, name in ((2, "main grad"), (3, "student grad")):
            _close(torch.cat([out[fusion, mtp][i] for out in results], -1), ref[i], f"{fusion} {mtp} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_megatron_pieces_equal_the_cpu_losses(dtype):
    main, student, labels, loss_mask, segment_ids = _batch(b=2, s=64, v=1000, seed=9, dtype=dtype)
    cpu = _ours(main, student, labels, loss_mask, segment_ids, 1, "self-distill", fusion=True)
    cuda = [t.detach().cuda().requires_grad_() for t in (main, student)]
    cuda += [t.cuda() for t in (labels, loss_mask, segment_ids)]
    got = _ours(*cuda, 1, "self-distill", fusion=True, overwrite_logits=True)
    tol = RTOL * 10 if dtype == torch.float32 else 1e-2
    for name, a, e in zip(["lm loss", "mtp loss", "main grad", "student grad"], got, cpu):
        _close(a.cpu(), e, name, rtol=tol)


@pytest.mark.gpu
def test_cuda_loss_memory_at_8k_positions_of_a_160k_vocabulary():
    """bf16 [1, 8192, 163840] main + MTP logits: loss + backward peak beyond the logits."""
    b, s, v = 1, 8192, 163840
    g = torch.Generator(device="cuda").manual_seed(0)

    def logits():
        return torch.randn(s, b, v, generator=g, device="cuda", dtype=torch.bfloat16).transpose(0, 1).requires_grad_()

    main, student = logits(), logits()
    labels = torch.randint(0, v, (b, s), device="cuda", generator=g)
    loss_mask = torch.ones(b, s, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lm, _ = lm_loss(main, labels, loss_mask, fusion=True, overwrite_logits=True)
    kl, _ = mtp_self_distillation_loss(student, main, loss_mask, 1, overwrite_logits=True)
    (lm / s + 0.1 * kl / s).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    chunk_bytes = losses.CUDA_CHUNK_ELEMENTS * 4
    logits_bytes = main.numel() * main.element_size()
    print(f"loss+backward extra peak {extra / 2**20:.0f} MiB; logits {logits_bytes / 2**20:.0f} MiB each, "
          f"fp32 chunk {chunk_bytes / 2**20:.0f} MiB")
    assert torch.isfinite(lm) and torch.isfinite(kl)
    assert extra <= 6 * chunk_bytes < logits_bytes


@pytest.mark.parametrize("argv, fused", [([], False), (["--cross-entropy-loss-fusion"], True)])
@pytest.mark.parametrize("mtp", ["self-distill", "ce"])
def test_cross_entropy_loss_fusion_flag_reaches_the_loss_plugins(argv, fused, mtp):
    from megatron_composer.config.presets import get_preset
    from megatron_composer.config.training import TrainingConfig
    from megatron_composer.training.arguments import parse_args
    from megatron_composer.training.loss_plugins import build_loss_plugins

    cfg = TrainingConfig.from_args(parse_args(argv + ["--mtp-loss", mtp]))
    assert cfg.cross_entropy_loss_fusion is fused
    lm, mtp_loss = build_loss_plugins(get_preset("tiny"), cfg)
    assert lm.fusion is fused and mtp_loss.fusion is fused and mtp_loss.kind == mtp


@pytest.mark.parametrize("fusion", [False, True], ids=["torch", "megatron-fused"])
@pytest.mark.parametrize("mtp", ["self-distill", "ce"])
def test_loss_plugins_in_the_loops_order_equal_the_references(fusion, mtp):
    """LMLoss then MTPLoss (depths 1, 2) on fresh logits, as Trainer.step calls them."""
    from types import SimpleNamespace

    from megatron_composer.parallel import shift_left
    from megatron_composer.training.loss_plugins import LMLoss, MTPLoss, ModelOutput

    main, student, labels, loss_mask, segment_ids = _batch(seed=13)
    deeper = _batch(seed=14)[1]
    ref1 = _reference(main, student, labels, loss_mask, segment_ids, 1, mtp)
    ref2 = _reference(main, deeper, labels, loss_mask, segment_ids, 2, mtp)
    leaves = (main, student, deeper)
    out = ModelOutput(main * 1.0, [student * 1.0, deeper * 1.0])  # not leaves, as a layer's outputs
    batch = SimpleNamespace(labels=labels, loss_mask=loss_mask, segment_ids=segment_ids)
    plugins = [LMLoss(scale=0.5, fusion=fusion), MTPLoss(2, mtp, scale=0.3, fusion=fusion)]
    sums = [p.loss_sum(batch, out, shift_left) for p in plugins]
    grads = torch.autograd.grad(sum(p.scale * s for p, s in zip(plugins, sums)), leaves)
    _close(sums[0], ref1[0], "lm loss")
    _close(sums[1], ref1[1] + ref2[1], "mtp loss")
    _close(grads[0], ref1[2], "main grad")  # the LM loss's only: the teacher is detached
    _close(grads[1], ref1[3], "depth-1 grad")
    _close(grads[2], ref2[3], "depth-2 grad")


@pytest.mark.parametrize("fusion", [False, True])
def test_fusion_runs_megatrons_fused_cross_entropy_code_per_chunk(monkeypatch, fusion):
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    calls = []
    original = VocabParallelCrossEntropy.calculate_predicted_logits

    def spy(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(VocabParallelCrossEntropy, "calculate_predicted_logits", staticmethod(spy))
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 5 * 3 * 50)
    main, _, labels, loss_mask, _ = _batch()  # s = 23: chunks of 5, 5, 5, 5, 3 positions
    lm_loss(main, labels, loss_mask, fusion=fusion)
    assert calls == ([(5, 3, 50)] * 4 + [(3, 3, 50)] if fusion else [])


def test_a_second_backward_through_overwritten_logits_raises():
    main, _, labels, loss_mask, _ = _batch()
    total, _ = lm_loss(main * 1.0, labels, loss_mask, overwrite_logits=True)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()
