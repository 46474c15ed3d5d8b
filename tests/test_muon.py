"""Newton-Schulz and the single-process Muon against torch.optim.Muon and a plain fp32 reference."""
import io
import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from megatron_composer.optim.muon import (
    DEFAULT_NS_COEFFICIENTS,
    Muon,
    NewtonSchulzConfig,
    lr_regions,
    matrix_blocks,
    newton_schulz,
    orthogonalize_local,
)

SHAPES = [(24, 24), (16, 40), (40, 16)]  # square, wide, tall


def reference_ns(G, steps=5, coefficients=DEFAULT_NS_COEFFICIENTS, eps=1e-7):
    """Newton-Schulz written out the obvious way, fp32, one matrix."""
    a, b, c = coefficients
    X = G.float()
    if X.shape[0] > X.shape[1]:
        X = X.T
    X = X / max(torch.linalg.norm(X).item(), eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


class ReferenceMuon:
    """Muon as the torch.optim.Muon docs describe it, one block at a time, fp32.

    blocks: optional list of (index, shape) sub-matrices of each parameter.
    """

    def __init__(self, params, lr, weight_decay, momentum, nesterov, adjust_lr_fn=None, blocks=None):
        self.params, self.lr, self.wd, self.mu, self.nesterov = params, lr, weight_decay, momentum, nesterov
        self.adjust = adjust_lr_fn
        self.blocks = blocks or [None] * len(params)
        self.bufs = [torch.zeros_like(p) for p in params]

    def scale(self, A, B):
        if self.adjust == "match_rms_adamw":
            return 0.2 * math.sqrt(max(A, B))
        return math.sqrt(max(1.0, A / B))

    def step(self, grads):
        for p, g, buf, blocks in zip(self.params, grads, self.bufs, self.blocks):
            buf.copy_(self.mu * buf + (1 - self.mu) * g)
            u = (1 - self.mu) * g + self.mu * buf if self.nesterov else buf.clone()
            p.mul_(1 - self.lr * self.wd)
            for index in blocks or [(slice(None), slice(None))]:
                o = reference_ns(u[index])
                p[index] -= self.lr * self.scale(*o.shape) * o


@pytest.mark.parametrize("shape", SHAPES + [(1, 8), (8, 1)])
def test_newton_schulz_bf16_is_torch_bit_for_bit(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = newton_schulz(G)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, _zeropower_via_newtonschulz(G, DEFAULT_NS_COEFFICIENTS, 5, 1e-7))


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_batches_over_leading_dims(shape):
    G = torch.randn(2, 3, *shape, generator=torch.Generator().manual_seed(2))
    batched = newton_schulz(G)
    for i in range(2):
        for j in range(3):
            assert torch.equal(batched[i, j], newton_schulz(G[i, j]))
    fp32 = newton_schulz(G, dtype=torch.float32)
    ref = torch.stack([reference_ns(G[i, j]) for i in range(2) for j in range(3)]).view_as(G)
    assert (fp32 - ref).abs().max() < 1e-5


def test_newton_schulz_leaves_input_alone_and_orthogonalizes():
    G = torch.randn(32, 64, dtype=torch.bfloat16)
    before = G.clone()
    O = newton_schulz(G, steps=10, dtype=torch.float32)
    assert torch.equal(G, before)
    s = torch.linalg.svdvals(O)
    assert s.min() > 0.6 and s.max() < 1.25  # the quintic's band, not exactly 1
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6, dtype=torch.bfloat16))


def _train_pair(ours, theirs, ps, qs, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_bf16_updates_equal_torch_optim_muon(nesterov, adjust_lr_fn):
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(s, generator=gen) for s in SHAPES + SHAPES]
    qs = [p.clone() for p in ps]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    _train_pair(Muon(ps, **kw), torch.optim.Muon(qs, **kw), ps, qs, steps=4)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_updates_equal_reference(nesterov, weight_decay):
    gen = torch.Generator().manual_seed(4)
    ps = [torch.randn(s, generator=gen) for s in SHAPES]
    qs = [p.clone() for p in ps]
    ours = Muon(ps, lr=0.02, weight_decay=weight_decay, nesterov=nesterov, ns_dtype=torch.float32)
    ref = ReferenceMuon(qs, 0.02, weight_decay, 0.95, nesterov)
    gen = torch.Generator().manual_seed(5)
    _step_and_compare(ours, ref, ps, qs, gen, steps=5)


def _step_and_compare(ours, ref, ps, qs, gen, steps):
    """Feed both optimizers the same random gradients; params must agree to 1e-6."""
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        for p, g in zip(ps, grads):
            p.grad = g
        ours.step()
        ref.step(grads)
    for p, q in zip(ps, qs):
        assert (p - q).abs().max() < 1e-6


def _blocks_of(shape, split):
    return [(slice(*b.rows), slice(*b.cols)) for b in matrix_blocks(shape, split)]


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_splits_orthogonalize_each_block_with_its_own_lr(adjust_lr_fn):
    specs = [
        ((24, 16), {"rows": 4}),  # query heads
        ((16, 24), {"cols": 3}),  # output projection heads
        ((32, 12), {"rows": [6, 10, 6, 10]}),  # K and V of each head, unequal
        ((24, 10), {"rows": 2, "cols": [4, 6]}),  # a grid with unequal columns
        ((20, 12), None),
    ]
    gen = torch.Generator().manual_seed(6)
    ps = [torch.randn(s, generator=gen) for s, _ in specs]
    qs = [p.clone() for p in ps]
    groups = [{"params": [p], "split": split} for p, (_, split) in zip(ps, specs)]
    ours = Muon(groups, lr=0.03, weight_decay=0.05, adjust_lr_fn=adjust_lr_fn, ns_dtype=torch.float32)
    ref = ReferenceMuon(qs, 0.03, 0.05, 0.95, True, adjust_lr_fn, [_blocks_of(s, sp) for s, sp in specs])
    _step_and_compare(ours, ref, ps, qs, gen, steps=3)


def test_stacked_experts_equal_a_list_of_expert_params():
    gen = torch.Generator().manual_seed(7)
    stacked = torch.randn(5, 12, 8, generator=gen)
    experts = [stacked[e].clone() for e in range(5)]
    a = Muon([{"params": [stacked], "split": {"rows": 2}}], lr=0.02)
    b = Muon([{"params": experts, "split": {"rows": 2}}], lr=0.02)
    for _ in range(3):
        g = torch.randn(5, 12, 8, generator=gen)
        stacked.grad = g.clone()
        for e, p in enumerate(experts):
            p.grad = g[e].clone()
        a.step()
        b.step()
    assert torch.equal(stacked, torch.stack(experts))


def test_orthogonalize_local_dtype_and_shape():
    us = [torch.randn(3, 4, 6), torch.randn(8, 8)]
    cfg = NewtonSchulzConfig(dtype=torch.float32)
    out = orthogonalize_local(us, [{"cols": 2}, None], [cfg, cfg])
    assert [o.shape for o in out] == [u.shape for u in us] and all(o.dtype == torch.float32 for o in out)
    assert torch.allclose(out[0][1, :, 3:], reference_ns(us[0][1, :, 3:]), atol=1e-5)


def test_lr_regions_collapse_when_all_blocks_agree():
    assert lr_regions((12, 8), {"rows": 3}, (0, 1, 0, 12), 0.1, None) == [(None, 0.1)]
    regions = lr_regions((16, 8), {"rows": [4, 12]}, (0, 1, 2, 16), 0.1, None)
    assert [r[0][1] for r in regions] == [slice(0, 2), slice(2, 14)]  # local rows of the shard at 2
    assert regions[1][1] == pytest.approx(0.1 * math.sqrt(12 / 8))


def test_state_dict_round_trip_resumes_exactly():
    gen = torch.Generator().manual_seed(8)
    ps = [torch.randn(12, 8, generator=gen), torch.randn(6, 10, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in ps] for _ in range(4)]

    def make(params):
        return Muon([{"params": params[:1], "split": {"rows": [4, 8]}}, {"params": params[1:]}],
                    lr=0.02, ns_dtype=torch.float32)

    def run(opt, params, steps):
        for gs in steps:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()

    straight = [p.clone() for p in ps]
    run(make(straight), straight, grads)

    resumed = [p.clone() for p in ps]
    opt = make(resumed)
    run(opt, resumed, grads[:2])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = make(resumed)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["split"] == {"rows": [4, 8]}
    assert fresh.param_groups[0]["ns_dtype"] == torch.float32
    run(fresh, resumed, grads[2:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_rejects_bad_inputs_with_the_fix():
    with pytest.raises(ValueError, match="fewer than 2 dims"):
        Muon([torch.zeros(4)])
    with pytest.raises(ValueError, match="rows=3 does not divide the 8 rows"):
        Muon([{"params": [torch.zeros(8, 4)], "split": {"rows": 3}}])
    with pytest.raises(ValueError, match="sum to 8"):
        Muon([{"params": [torch.zeros(8, 4)], "split": {"rows": [3, 4]}}])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([torch.zeros(8, 4)], adjust_lr_fn="sqrt")
