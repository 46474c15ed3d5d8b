"""ShardedMuon / sharded_orthogonalize equal the unsharded Muon, over real gloo process groups."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_composer.optim.muon import Muon, NewtonSchulzConfig, orthogonalize_local
from megatron_composer.optim.param_groups import HeadGeometry, build_muon_adamw
from megatron_composer.optim.sharded_muon import (
    ShardedMuon,
    ShardLayout,
    chunk_range,
    plan_buckets,
    sharded_orthogonalize,
)
from tests.distributed import run_distributed

# (full shape, split): each a layout case for the dim-0 chunking at world 2 and 4.
SPECS = [
    ((8, 6), None),  # several same-shape tensors: one bucket, spread over owners
    ((8, 6), None),
    ((8, 6), None),
    ((7, 5), None),  # uneven rows
    ((5, 12), None),  # world 4: rows 2, 2, 1, 0 (an empty shard)
    ((12, 10), {"rows": 4}),  # heads held whole by one rank: no communication
    ((10, 6), {"rows": 5}),  # heads straddling shard boundaries
    ((6, 8), {"cols": 4}),  # output-projection heads: every rank holds a piece of each
    ((16, 6), {"rows": [3, 5, 3, 5]}),  # K/V blocks of unequal size: per-block lr
    ((5, 6, 4), None),  # stacked experts, chunked along the expert dim
    ((3, 8, 6), {"rows": 2}),
]
OPTIONS = [  # cycled over the param groups
    dict(nesterov=True, weight_decay=0.1, adjust_lr_fn=None),
    dict(nesterov=False, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
    dict(nesterov=True, weight_decay=0.05, adjust_lr_fn="match_rms_adamw"),
]


def _chunk(t, world, rank):
    lo, hi = chunk_range(t.shape[0], world, rank)
    return t[lo:hi]


def _groups(params, splits, full_index):
    """One group per tensor; options chosen by the index of its full tensor, so shards match references."""
    return [{"params": [p], "split": s, **OPTIONS[i % len(OPTIONS)]} for p, s, i in zip(params, splits, full_index)]


def _sharded_vs_full(rank, world, ns_dtype, max_bucket_numel):
    """Train full tensors with Muon and this rank's shards with ShardedMuon; return max |difference|."""
    gen = torch.Generator().manual_seed(0)
    WORLD = dist.group.WORLD
    full = [torch.randn(shape, generator=gen) for shape, _ in SPECS]
    splits = [split for _, split in SPECS]
    # local[k] = cut(full[i]) for (i, cut, layout) = cuts[k]; dense tensors are dim-0 chunks over the world.
    cuts = [(i, lambda t: _chunk(t, world, rank), ShardLayout(f.shape, WORLD)) for i, f in enumerate(full)]

    # Expert parallel: rank r owns experts [2r, 2r+2) whole; no row sharding, no communication.
    for e in range(2 * world):
        full.append(torch.randn(6, 4, generator=gen))
        splits.append({"rows": 2})
        if e // 2 == rank:
            cuts.append((len(full) - 1, lambda t: t, None))

    if world == 4:  # EP 2 x expert-FSDP 2: EP rank r//2 owns 2 experts, each row-sharded over {0,1} / {2,3}
        efsdp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        ep, er = rank // 2, rank % 2
        for e in range(4):
            full.append(torch.randn(6, 4, generator=gen))
            splits.append(None)
            if e // 2 == ep:
                cuts.append((len(full) - 1, lambda t: _chunk(t, 2, er), ShardLayout((6, 4), efsdp)))
        full.append(torch.randn(4, 6, 4, generator=gen))  # stacked [E, m, n]: EP slice, then chunked
        splits.append({"cols": 2})
        cuts.append((len(full) - 1, lambda t: _chunk(t[2 * ep : 2 * ep + 2], 2, er), ShardLayout((2, 6, 4), efsdp)))

    local = [cut(full[i]).clone() for i, cut, _ in cuts]
    layouts = {t: layout for t, (_, _, layout) in zip(local, cuts) if layout is not None}
    kw = dict(lr=0.05, ns_dtype=ns_dtype)
    ref = Muon(_groups(full, splits, range(len(full))), **kw)
    opt = ShardedMuon(_groups(local, [splits[i] for i, _, _ in cuts], [i for i, _, _ in cuts]), shard_layouts=layouts,
                      max_bucket_numel=max_bucket_numel, **kw)
    for _ in range(3):
        grads = [torch.randn(f.shape, generator=gen) for f in full]
        for f, g in zip(full, grads):
            f.grad = g
        for t, (i, cut, _) in zip(local, cuts):
            t.grad = cut(grads[i]).clone()
        ref.step()
        opt.step()
    diffs = [(t - cut(full[i])).abs().amax().item() if t.numel() else 0.0 for t, (i, cut, _) in zip(local, cuts)]

    # The pure function on its own, on fresh tensors.
    cfg = NewtonSchulzConfig(dtype=ns_dtype)
    dense = full[: len(SPECS)]
    outs = sharded_orthogonalize([_chunk(f, world, rank) for f in dense], [f.shape for f in dense], WORLD,
                                 splits[: len(SPECS)], config=cfg, max_bucket_numel=max_bucket_numel)
    whole = orthogonalize_local(dense, splits[: len(SPECS)], [cfg] * len(SPECS))
    diffs += [(o.float() - _chunk(w, world, rank).float()).abs().amax().item() if o.numel() else 0.0
              for o, w in zip(outs, whole)]
    return max(diffs)


def _fsdp2_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Tanh(), nn.Linear(12, 5, bias=False), nn.Tanh(),
                          nn.Linear(5, 3, bias=False))  # 5 and 3 rows: uneven shards
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def groups(m):
        return [{"params": [m[0].weight], "split": {"rows": 4}}, {"params": [m[2].weight, m[4].weight]}]

    opt = ShardedMuon(groups(model), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    ref_opt = Muon(groups(ref), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    buf_is_dtensor = isinstance(opt.state[model[0].weight]["momentum_buffer"], DTensor)
    # Checkpoint through torch.distributed.checkpoint: momentum (DTensor) and group options come back.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    restored = ShardedMuon(groups(model), lr=0.01, ns_dtype=torch.bfloat16)
    set_optimizer_state_dict(model, restored, get_optimizer_state_dict(model, opt))
    restored_ok = restored.param_groups[0]["split"] == {"rows": 4} and restored.param_groups[0]["lr"] == 0.05
    restored_ok &= all(torch.equal(opt.state[p]["momentum_buffer"].to_local(),
                                   restored.state[p]["momentum_buffer"].to_local()) for p in model.parameters())
    built, _ = build_muon_adamw(model.named_parameters(), HeadGeometry(1, 1, 1, 1), granularity="matrix")
    try:
        sharded_orthogonalize([torch.zeros(3, 4)], [(8, 4)], dist.group.WORLD)
        error = ""
    except ValueError as e:
        error = str(e)
    return diff, buf_is_dtensor and restored_ok, type(built).__name__, error


def _world2(rank, world):
    return {
        "fp32": _sharded_vs_full(rank, world, torch.float32, 1 << 26),
        "bf16": _sharded_vs_full(rank, world, torch.bfloat16, 1 << 26),
        "fsdp2": _fsdp2_body(rank, world),
    }


def _world4(rank, world):
    return {
        "fp32": _sharded_vs_full(rank, world, torch.float32, 1 << 26),
        # a tiny bucket cap splits buckets, so several are in flight at once
        "fp32_small_buckets": _sharded_vs_full(rank, world, torch.float32, 100),
    }


# One spawn per world size (process start dominates: torch + torch._dynamo per rank).
@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, 2)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4, 4)


@pytest.mark.parametrize("case", ["fp32", "fp32_small_buckets"])
def test_sharded_muon_equals_muon_fp32_world4(world4, case):
    diffs = [r[case] for r in world4]
    assert max(diffs) < 1e-6, diffs


def test_sharded_muon_equals_muon_fp32_world2(world2):
    diffs = [r["fp32"] for r in world2]
    assert max(diffs) < 1e-6, diffs


def test_sharded_muon_bf16_is_bit_identical_to_muon(world2):
    assert [r["bf16"] for r in world2] == [0.0, 0.0]


def test_fsdp2_fully_shard_training_equals_single_process_muon(world2):
    for diff, dtensor_state_round_trips, built, error in (r["fsdp2"] for r in world2):
        assert diff < 1e-6 and dtensor_state_round_trips and built == "ShardedMuon"
        assert "shards must be torch.chunk(full, 2, dim=0)" in error


# ---------------------------------------------------------------- single-process checks


@pytest.mark.parametrize("size", [0, 1, 5, 7, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_chunk_range_is_torch_chunk(size, world):
    chunks = torch.arange(size).chunk(world) if size else []
    for rank in range(world):
        lo, hi = chunk_range(size, world, rank)
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(lo, hi)) == want


def _plan(shapes, splits, world, max_bucket_numel=1 << 26):
    group = object()  # planning only compares groups by identity
    cfg = NewtonSchulzConfig()
    n = len(shapes)
    return plan_buckets(shapes, splits, [group] * n, [world] * n, [cfg] * n, max_bucket_numel)


def test_plan_keeps_whole_local_blocks_and_balances_the_rest():
    heads = _plan([(16, 8)], [{"rows": 8}], world=4)  # 2 heads per rank
    assert [e.owner for e in heads[0].entries] == [0, 0, 1, 1, 2, 2, 3, 3] and not heads[0].needs_comm

    mats = _plan([(8, 6)] * 8, [None] * 8, world=4)  # straddling: spread evenly
    assert len(mats) == 1 and sorted(e.owner for e in mats[0].entries) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert mats[0].needs_comm

    split = _plan([(8, 6)] * 8, [None] * 8, world=4, max_bucket_numel=2 * 48)
    assert [len(b.entries) for b in split] == [2, 2, 2, 2]


def test_plan_pieces_cover_every_block_once():
    for b in _plan([(10, 6), (6, 8), (5, 6, 4)], [{"rows": 5}, {"cols": 4}, None], world=4):
        for e in b.entries:
            covered = sorted((lo, hi) for _, lo, hi in e.pieces)
            assert covered[0][0] == 0 and covered[-1][1] == b.shape[0]
            assert all(a[1] == c[0] for a, c in zip(covered, covered[1:]))
            assert 0 <= e.owner < 4


def test_unsharded_tensors_need_no_process_group():
    gen = torch.Generator().manual_seed(2)
    ps = [torch.randn(12, 8, generator=gen), torch.randn(3, 6, 4, generator=gen)]
    qs = [p.clone() for p in ps]
    a = ShardedMuon([{"params": ps[:1], "split": {"rows": 3}}, {"params": ps[1:]}], lr=0.02)
    b = Muon([{"params": qs[:1], "split": {"rows": 3}}, {"params": qs[1:]}], lr=0.02)
    for _ in range(2):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
