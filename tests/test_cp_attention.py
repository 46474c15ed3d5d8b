"""Context parallelism for MLA: CP=2 and CP=4 reproduce CP=1 exactly (fp32).

For the tiny model with MTP, plain and packed (per-document zigzag) batches:
main and MTP logits, the LM and MTP self-distillation losses and every
parameter gradient (summed over the CP group, as megatron's DDP does over
DP x CP) equal the CP=1 run to a relative 1e-5. Also: the latent all-gather's
backward is a reduce-scatter, and the spec selects our CP attention.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_composer.config import get_preset
from megatron_composer.parallel import (
    ZigzagLayout,
    pad_batch,
    packed_seq_params_for,
    shift_left,
    zigzag_batch,
    zigzag_merge,
    zigzag_split,
)
from megatron_composer.training.batches import Batch
from tests.distributed import run_distributed

TINY = get_preset("tiny")
RTOL = 1e-5
MTP_SCALE = 0.1


def _batch(doc_lengths, rows=1, packed=False, seed=0) -> Batch:
    """A global micro-batch: [rows, sum(doc_lengths)] tokens, some masked labels."""
    g = torch.Generator().manual_seed(seed)
    s = sum(doc_lengths)
    tokens = torch.randint(3, TINY.vocab_size, (rows, s), generator=g)
    labels = torch.randint(3, TINY.vocab_size, (rows, s), generator=g)
    loss_mask = (torch.rand(rows, s, generator=g) > 0.2).float()
    segments = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    positions = torch.cat([torch.arange(n) for n in doc_lengths])
    return Batch(tokens, labels, loss_mask, positions.expand(rows, s).clone(),
                 segments.expand(rows, s).clone(), packed_seq_params_for(doc_lengths) if packed else None)


# Plain: two rows of 32 tokens, each with documents (MTP masks respect them).
# Packed: documents of 24, 16, 8 and 16 tokens, each a multiple of 2*CP for CP <= 4.
# Padded: odd documents, split with --pad-to-multiple at CP=2.
CASES = {
    "plain": dict(doc_lengths=[20, 12], rows=2, packed=False),
    "packed": dict(doc_lengths=[24, 16, 8, 16], rows=1, packed=True),
    "padded": dict(doc_lengths=[13, 6, 9], rows=1, packed=True),
}


def _setup(cp):
    from megatron_composer.models import build_model
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    layout = ParallelLayout(world_size=env.world_size, cp=cp, num_experts=TINY.num_experts)
    initialize_parallel(layout, seed=1234)
    return build_model(TINY, layout, seq_length=64)


def _run_case(model, batch, cp):
    """Forward + backward of LM + MTP self-distillation on this rank's share."""
    from megatron.core import parallel_state

    from megatron_composer.models import composer_forward
    from megatron_composer.parallel import cp_shift_left
    from megatron_composer.training.losses import (
        lm_loss,
        mtp_cross_entropy_loss,
        mtp_self_distillation_loss,
    )

    rank = parallel_state.get_context_parallel_rank()
    group = parallel_state.get_context_parallel_group() if cp > 1 else None
    local = zigzag_batch(batch, cp, rank)
    if cp > 1:
        layout = ZigzagLayout.for_local_tokens(local.tokens.shape[1], cp, local.packed_seq_params)
        shift = lambda x, d, fill: cp_shift_left(x, d, fill, layout, rank, group)  # noqa: E731
    else:
        shift = shift_left
    model.zero_grad(set_to_none=True)
    logits, mtp = composer_forward(model, local.tokens, local.position_ids, local.packed_seq_params)
    lm_sum, lm_n = lm_loss(logits, local.labels, local.loss_mask)
    mtp_sum, mtp_n = mtp_self_distillation_loss(mtp[0], logits, local.loss_mask, 1,
                                                local.segment_ids, shift)
    ce_sum, _ = mtp_cross_entropy_loss(mtp[0].detach(), local.labels, local.loss_mask, 1,
                                       local.segment_ids, shift)
    sums = torch.stack([lm_sum.detach(), lm_n, mtp_sum.detach(), mtp_n, ce_sum]).double()
    if cp > 1:
        dist.all_reduce(sums, group=group)
    loss = lm_sum / sums[1] + MTP_SCALE * mtp_sum / sums[3]
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if cp > 1:  # DDP sums over DP x CP; every DP replica here runs the same batch
            dist.all_reduce(g, group=group)
        grads[name] = g
    return logits.detach(), mtp[0].detach(), sums, grads


def _gather_check(group):
    """The latent all-gather's output and its backward (a reduce-scatter) on `group`."""
    from megatron_composer.attention.cp import latent_all_gather

    rank = dist.get_rank(group)
    local = torch.full((2, 3), float(rank + 1), requires_grad=True)
    full = latent_all_gather(local, group).wait()
    weights = torch.arange(full.numel(), dtype=torch.float32).view_as(full)
    (full * weights * (rank + 1)).sum().backward()
    return full.detach(), local.grad


SHIFT_DOCS = (16, 8, 24)


def _shift_check(cp):
    """cp_shift_left over real collectives: [2, 48] global ids, shifts 1 and 2, 3 documents."""
    from megatron.core import parallel_state

    from megatron_composer.parallel import cp_shift_left

    layout = ZigzagLayout(SHIFT_DOCS, cp)
    rank = parallel_state.get_context_parallel_rank()
    local = zigzag_split(torch.arange(2 * sum(SHIFT_DOCS)).view(2, -1), layout, rank)
    group = parallel_state.get_context_parallel_group()
    return {k: cp_shift_left(local, k, -1, layout, rank, group) for k in (1, 2)}


def _cp_body(rank, world, state_path):
    """CP=4 on all ranks, then CP=2 x DP=2 in the same processes (one spawn)."""
    from megatron.core import parallel_state

    from megatron_composer.checkpoint import load_model_state_dict

    results = {}
    for cp, cases in ((4, ["plain", "packed"]), (2, ["plain", "packed", "padded"])):
        model = _setup(cp)
        results[(cp, "shift")] = _shift_check(cp)
        load_model_state_dict(model, torch.load(state_path))
        for name in cases:
            batch = _batch(**CASES[name])
            if name == "padded":
                batch = pad_batch(batch, 2 * cp)
            results[(cp, name)] = _run_case(model, batch, cp)
    results["gather"] = _gather_check(parallel_state.get_context_parallel_group())
    results["cp_rank"] = parallel_state.get_context_parallel_rank()
    return results


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """CP=1 results for every case (in this process) and the 4-rank CP=4 / CP=2 results."""
    from megatron_composer.checkpoint import load_model_state_dict, model_state_dict

    path = tmp_path_factory.mktemp("cp") / "state.pt"
    model = _setup(1)
    state = model_state_dict(model)
    for k in state:  # a nonzero expert bias, so routing with the bias is compared too
        if k.endswith("expert_bias"):
            state[k].copy_(torch.linspace(-0.01, 0.01, state[k].numel()))
    load_model_state_dict(model, state)
    torch.save(state, path)
    ref = {}
    for name, case in CASES.items():
        batch = _batch(**case)
        if name == "padded":
            batch = pad_batch(batch, 4)  # what CP=2 pads to
        ref[name] = _run_case(model, batch, 1)
    return ref, run_distributed(_cp_body, 4, str(path))


@pytest.mark.parametrize("cp,name", [(4, "plain"), (4, "packed"), (2, "plain"), (2, "packed"),
                                     (2, "padded")])
def test_cp_equals_cp1_logits_losses_and_gradients(cp_runs, cp, name):
    ref, results = cp_runs
    logits_ref, mtp_ref, sums_ref, grads_ref = ref[name]
    per_rank = [r[(cp, name)] for r in results[:cp]]  # ranks 0..cp-1 form a CP group
    lengths = CASES[name]["doc_lengths"]
    if name == "padded":
        lengths = [-(-n // (2 * cp)) * (2 * cp) for n in lengths]
    layout = ZigzagLayout(tuple(lengths) if CASES[name]["packed"] else (sum(lengths),), cp)
    logits = zigzag_merge([r[0] for r in per_rank], layout, dim=1)
    mtp = zigzag_merge([r[1] for r in per_rank], layout, dim=1)
    assert _rel_err(logits, logits_ref) < RTOL, _rel_err(logits, logits_ref)
    assert _rel_err(mtp, mtp_ref) < RTOL, _rel_err(mtp, mtp_ref)
    for sums in (r[2] for r in per_rank):  # LM, MTP distillation and MTP CE sums, counts
        torch.testing.assert_close(sums, sums_ref, rtol=RTOL, atol=0)
    for grads in (r[3] for r in per_rank):
        assert grads.keys() == grads_ref.keys()
        errors = {n: _rel_err(grads[n], grads_ref[n]) for n in grads_ref}
        worst = max(errors, key=errors.get)
        assert errors[worst] < RTOL, (worst, errors[worst])


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_shift_left_equals_the_global_shift(cp_runs, cp):
    _, results = cp_runs
    layout = ZigzagLayout(SHIFT_DOCS, cp)
    x = torch.arange(2 * sum(SHIFT_DOCS)).view(2, -1)
    for k in (1, 2):
        expected, at = [], 0
        for n in SHIFT_DOCS:  # shifts never cross a document
            expected.append(shift_left(x[:, at:at + n], k, -1))
            at += n
        merged = zigzag_merge([r[(cp, "shift")][k] for r in results[:cp]], layout)
        assert merged.tolist() == torch.cat(expected, dim=1).tolist()


def test_latent_all_gather_backward_reduce_scatters(cp_runs):
    _, results = cp_runs
    w = torch.arange(12, dtype=torch.float32).view(4, 3)
    for r in results:
        full, grad = r["gather"]
        rank = r["cp_rank"]
        assert full.tolist() == [[1.0] * 3] * 2 + [[2.0] * 3] * 2
        # d/d local of sum_r (r+1) * <full, w> = (1 + 2) * this rank's rows of w
        torch.testing.assert_close(grad, 3 * w[2 * rank:2 * rank + 2])


def test_spec_selects_latent_cp_attention():
    from megatron_composer.attention.cp import ContextParallelMLASelfAttention, ZigzagCoreAttention
    from megatron_composer.attention.core import MLACoreAttention
    from megatron_composer.models import transformer_config
    from megatron_composer.models.builder import composer_block_spec
    from megatron_composer.parallel import ParallelLayout

    for cp, module, core in ((1, "MLASelfAttention", MLACoreAttention),
                             (2, "ContextParallelMLASelfAttention", ZigzagCoreAttention)):
        spec = composer_block_spec(transformer_config(TINY, ParallelLayout(world_size=cp, cp=cp)))
        for layer in spec.layer_specs:
            attention = layer.submodules.self_attention
            assert attention.module.__name__ == module
            assert attention.submodules.core_attention is core
    assert issubclass(ContextParallelMLASelfAttention, __import__(
        "megatron.core.transformer.multi_latent_attention", fromlist=["MLASelfAttention"]).MLASelfAttention)
