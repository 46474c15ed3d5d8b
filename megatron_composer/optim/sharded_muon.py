"""Muon on sharded parameters: all-to-all shards into whole matrices, orthogonalize, all-to-all back.

Layout. A sharded tensor is this rank's dim-0 chunk of a full parameter over
a process group, with torch.chunk semantics: chunk size ceil(d0 / W), so
chunks can be uneven and trailing ones empty. That is what FSDP2
`fully_shard` (Shard(0)) produces; `ShardedMuon` reads it from the DTensor's
mesh and placements, or from an explicit `ShardLayout` for plain tensors.
A 2-D parameter is chunked along its rows, a stacked [E, m, n] one along its
experts. Expert parallelism needs nothing special: an EP rank's experts are
simply other parameters, whole (group None) or chunked over the expert-FSDP
group.

Pipeline (the same-shape "megabatch" design of microsoft/dion, which Composer
2.5 describes for its 0.2 s step on the 1T model):

1. Plan, from shapes alone and so identically on every rank: every block
   (a whole matrix, a head, an expert, see `muon.Block`) of every tensor
   gets an owner rank. A block held whole by one rank is owned by it (heads
   inside a shard, experts under EP need no communication); the rest go to
   the least loaded rank, by Newton-Schulz flops. Same-shape blocks of one
   group and Newton-Schulz config form buckets (at most `max_bucket_numel`
   elements each).
2. Per bucket: pack this rank's row pieces of every block by owner, one
   `all_to_all_single` (async) to the owners, who assemble whole blocks,
   run one batched Newton-Schulz, and send the pieces back through the
   reverse all_to_all (async). Up to `prefetch` buckets' gathers are in
   flight while another bucket is orthogonalized, and its scatter overlaps
   the next bucket's compute. Pieces travel in the Newton-Schulz dtype
   (Newton-Schulz casts to it first anyway, so nothing is lost).

Momentum, weight decay and lr scaling are `muon.Muon.step`'s; only the
orthogonalization differs, so with any layout the result equals the
unsharded `Muon` (tests/test_sharded_muon.py, fp32, atol 1e-6).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Hashable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_composer.optim.muon import (
    Block,
    Box,
    Muon,
    NewtonSchulzConfig,
    Split,
    as_matrices,
    full_box,
    matrix_blocks,
    orthogonalize_local,
    split_key,
)

DEFAULT_MAX_BUCKET_NUMEL = 1 << 26


@dataclass(frozen=True)
class ShardLayout:
    """A plain tensor that is the dim-0 chunk (torch.chunk) `group rank` of `full_shape` over `group`."""

    full_shape: tuple[int, ...]
    group: Optional[dist.ProcessGroup] = None


def chunk_range(size: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of chunk `rank` when `size` is split like torch.chunk(.., world) (empty past the end)."""
    step = -(-size // world) if size else 0
    lo = min(rank * step, size)
    return lo, min(lo + step, size)


def shard_box(full_shape: Sequence[int], world: int, rank: int) -> Box:
    """The part of the full [B, m, n] matrix stack that dim-0 chunk `rank` holds."""
    lo, hi = chunk_range(full_shape[0], world, rank)
    if len(full_shape) == 2:
        return (0, 1, lo, hi)
    inner = math.prod(full_shape[1:-2])
    return (lo * inner, hi * inner, 0, full_shape[-2])


def local_shape(full_shape: Sequence[int], world: int, rank: int) -> tuple[int, ...]:
    lo, hi = chunk_range(full_shape[0], world, rank)
    return (hi - lo, *full_shape[1:])


# ---------------------------------------------------------------- plan


@dataclass
class _Entry:
    item: int
    block: Block
    pieces: list[tuple[int, int, int]]  # (rank, lo, hi): rows of the block that rank holds, rank order
    owner: int = -1


@dataclass
class _Bucket:
    group: Hashable  # a token standing for the process group
    world: int
    config: NewtonSchulzConfig
    shape: tuple[int, int]
    entries: list[_Entry] = field(default_factory=list)

    @property
    def needs_comm(self) -> bool:
        return any(q != e.owner for e in self.entries for q, _, _ in e.pieces)


def _pieces(full_shape, world: int, blk: Block) -> list[tuple[int, int, int]]:
    out = []
    for q in range(world):
        b0, b1, r0, r1 = shard_box(full_shape, world, q)
        lo, hi = max(blk.rows[0], r0), min(blk.rows[1], r1)
        if b0 <= blk.batch < b1 and lo < hi:
            out.append((q, lo - blk.rows[0], hi - blk.rows[0]))
    return out


def plan_buckets(
    full_shapes: Sequence[Sequence[int]],
    splits: Sequence[Split],
    groups: Sequence[Hashable],
    worlds: Sequence[int],
    configs: Sequence[NewtonSchulzConfig],
    max_bucket_numel: int = DEFAULT_MAX_BUCKET_NUMEL,
    locality_slack: float = 1.25,
) -> list[_Bucket]:
    """Buckets of same-shape blocks with an owner per block; a pure function of shapes.

    groups[i]: any hashable token for tensor i's process group. Items must be
    listed in the same order on every rank of a group. Owners: a block held
    whole by one rank stays there while that rank's load is under
    `locality_slack` x the even share; every other block goes to the least
    loaded rank (ties: the rank holding most of it, then the lowest).
    """
    keyed: dict = {}
    for i, (shape, split, group, world, cfg) in enumerate(zip(full_shapes, splits, groups, worlds, configs)):
        for blk in matrix_blocks(shape, split):
            key = (group, cfg, blk.shape)
            if key not in keyed:
                keyed[key] = _Bucket(group, world, cfg, blk.shape)
            keyed[key].entries.append(_Entry(i, blk, _pieces(shape, world, blk)))

    buckets = []
    for b in keyed.values():
        per_bucket = max(1, max_bucket_numel // math.prod(b.shape))
        for k in range(0, len(b.entries), per_bucket):
            buckets.append(_Bucket(b.group, b.world, b.config, b.shape, b.entries[k : k + per_bucket]))

    by_group = defaultdict(list)
    for b in buckets:
        by_group[b.group].append(b)
    for group_buckets in by_group.values():
        world = group_buckets[0].world
        target = sum(_ns_cost(b.shape) * len(b.entries) for b in group_buckets) / world
        load = [0.0] * world
        for b in group_buckets:  # pass 1: keep whole-local blocks where they are
            for e in b.entries:
                if len(e.pieces) == 1 and load[e.pieces[0][0]] + _ns_cost(b.shape) <= locality_slack * target:
                    e.owner = e.pieces[0][0]
                    load[e.owner] += _ns_cost(b.shape)
        for b in group_buckets:  # pass 2: the rest to the least loaded rank
            for e in b.entries:
                if e.owner < 0:
                    held = defaultdict(int, {q: hi - lo for q, lo, hi in e.pieces})
                    e.owner = min(range(world), key=lambda q: (load[q], -held[q], q))
                    load[e.owner] += _ns_cost(b.shape)
    return buckets


def _ns_cost(shape: tuple[int, int]) -> float:
    m, n = shape
    return float(m * n * min(m, n))


# ---------------------------------------------------------------- per-rank schedule

Index = tuple[int, int, int, int, int, int]  # (item, batch, row_lo, row_hi, col_lo, col_hi) in a local [B, m, n]


@dataclass
class _Schedule:
    """What one rank does for one bucket; everything but the tensors."""

    group: Hashable
    config: NewtonSchulzConfig
    shape: tuple[int, int]
    needs_comm: bool
    owned: int  # blocks this rank orthogonalizes
    send: list[Index]  # my pieces of blocks others own, grouped by owner in rank order
    recv: list[tuple[int, int, int]]  # (slot, lo, hi): others' pieces of my blocks, grouped by sender
    local: list[tuple[int, int, int, Index]]  # (slot, lo, hi, where): my pieces of my blocks
    send_sizes: list[int]
    recv_sizes: list[int]


def _local_index(item: int, blk: Block, lo: int, hi: int, box: Box) -> Index:
    b0, _, r0, _ = box
    start = blk.rows[0] - r0
    return (item, blk.batch - b0, start + lo, start + hi, blk.cols[0], blk.cols[1])


@lru_cache(maxsize=32)
def _schedules(signature: tuple, ranks: tuple, max_bucket_numel: int) -> list[_Schedule]:
    """signature: per tensor (full shape, split key, group token, world, config); ranks: my rank per token."""
    shapes = [sig[0] for sig in signature]
    splits = [dict(zip(("rows", "cols"), sig[1])) for sig in signature]
    rank_of = dict(ranks)
    buckets = plan_buckets(shapes, splits, [sig[2] for sig in signature], [sig[3] for sig in signature],
                           [sig[4] for sig in signature], max_bucket_numel)
    out = []
    for b in buckets:
        rank, n = rank_of[b.group], b.shape[1]
        owned = [e for e in b.entries if e.owner == rank]
        slot = {id(e): k for k, e in enumerate(owned)}
        send = [[] for _ in range(b.world)]
        recv = [[] for _ in range(b.world)]
        local = []
        for e in b.entries:
            for q, lo, hi in e.pieces:
                if q == rank:
                    where = _local_index(e.item, e.block, lo, hi, shard_box(shapes[e.item], b.world, rank))
                    if e.owner == rank:
                        local.append((slot[id(e)], lo, hi, where))
                    else:
                        send[e.owner].append(where)
                elif e.owner == rank:
                    recv[q].append((slot[id(e)], lo, hi))
        out.append(_Schedule(
            b.group, b.config, b.shape, b.needs_comm, len(owned),
            [w for ws in send for w in ws], [r for rs in recv for r in rs], local,
            [sum((w[3] - w[2]) * n for w in ws) for ws in send],
            [sum((hi - lo) * n for _, lo, hi in rs) for rs in recv],
        ))
    return out


# ---------------------------------------------------------------- execution


def _view(mats: list[Tensor], where: Index) -> Tensor:
    item, b, r0, r1, c0, c1 = where
    return mats[item][b, r0:r1, c0:c1]


def _flat_views(buf: Tensor, row_counts, n: int) -> list[Tensor]:
    views, off = [], 0
    for rows in row_counts:
        views.append(buf[off : off + rows * n].view(rows, n))
        off += rows * n
    return views


class _BucketRun:
    """One bucket on this rank: gather pieces to owners, orthogonalize, scatter pieces back."""

    def __init__(self, sched: _Schedule, group, mats: list[Tensor], outs: list[Tensor], device):
        self.s, self.group, self.mats, self.outs, self.device = sched, group, mats, outs, device
        self.work = None

    def _launch(self, out: Tensor, inp: Tensor, out_sizes, in_sizes) -> None:
        self.work = None
        if self.s.needs_comm:
            self.work = dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=self.group, async_op=True)

    def start_gather(self) -> None:
        s, n = self.s, self.s.shape[1]
        self.send_buf = torch.empty(sum(s.send_sizes), dtype=s.config.dtype, device=self.device)
        for v, where in zip(_flat_views(self.send_buf, [w[3] - w[2] for w in s.send], n), s.send):
            v.copy_(_view(self.mats, where))
        self.recv_buf = torch.empty(sum(s.recv_sizes), dtype=s.config.dtype, device=self.device)
        self._launch(self.recv_buf, self.send_buf, s.recv_sizes, s.send_sizes)

    def compute(self) -> None:
        if self.work is not None:
            self.work.wait()
        s, (m, n) = self.s, self.s.shape
        stack = torch.empty(s.owned, m, n, dtype=s.config.dtype, device=self.device)
        for k, lo, hi, where in s.local:
            stack[k, lo:hi].copy_(_view(self.mats, where))
        recv_views = _flat_views(self.recv_buf, [hi - lo for _, lo, hi in s.recv], n)
        for (k, lo, hi), v in zip(s.recv, recv_views):
            stack[k, lo:hi].copy_(v)
        result = s.config(stack) if s.owned else stack
        for k, lo, hi, where in s.local:
            _view(self.outs, where).copy_(result[k, lo:hi])
        for (k, lo, hi), v in zip(s.recv, recv_views):  # the way back has the layout that came in
            v.copy_(result[k, lo:hi])
        self.back_buf = self.send_buf
        self._launch(self.back_buf, self.recv_buf, s.send_sizes, s.recv_sizes)

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        s, n = self.s, self.s.shape[1]
        for v, where in zip(_flat_views(self.back_buf, [w[3] - w[2] for w in s.send], n), s.send):
            _view(self.outs, where).copy_(v)
        self.send_buf = self.recv_buf = self.back_buf = None


GroupArg = Union[None, dist.ProcessGroup, Sequence[Optional[dist.ProcessGroup]]]
ConfigArg = Union[NewtonSchulzConfig, Sequence[NewtonSchulzConfig]]


def sharded_orthogonalize(
    shards: Sequence[Tensor],
    full_shapes: Sequence[Sequence[int]],
    group: GroupArg = None,
    splits: Optional[Sequence[Split]] = None,
    *,
    config: ConfigArg = NewtonSchulzConfig(),
    max_bucket_numel: int = DEFAULT_MAX_BUCKET_NUMEL,
    prefetch: int = 2,
) -> list[Tensor]:
    """Newton-Schulz of every block of every sharded tensor; returns this rank's shards of the result.

    shards[i]: this rank's dim-0 chunk (torch.chunk semantics, possibly
        empty) of a tensor of shape full_shapes[i] ([..., m, n]) over
        group[i]; group None (or of size 1) means the tensor is whole here.
    group: one process group for all tensors, or one per tensor.
    splits[i]: the block split of tensor i (`muon.Split`), default whole.
    config: Newton-Schulz settings, one for all or one per tensor.
    Returns tensors shaped like `shards`, in config.dtype. Collective: every
    rank of a group must pass that group's tensors with the same shapes,
    splits and configs, in the same order. The plan is cached per signature.
    """
    count = len(shards)
    groups = list(group) if isinstance(group, (list, tuple)) else [group] * count
    configs = list(config) if isinstance(config, (list, tuple)) else [config] * count
    splits = list(splits) if splits is not None else [None] * count
    if not len(full_shapes) == len(groups) == len(configs) == len(splits) == count:
        raise ValueError(
            f"got {count} shards but {len(full_shapes)} shapes, {len(groups)} groups, "
            f"{len(configs)} configs, {len(splits)} splits"
        )
    worlds = [dist.get_world_size(g) if g is not None else 1 for g in groups]
    dist_items = [i for i in range(count) if worlds[i] > 1]
    local_items = [i for i in range(count) if worlds[i] == 1]

    tokens: dict = {}  # process group -> token (first appearance); the plan never holds groups
    group_of, signature, ranks = {}, [], {}
    for i in dist_items:
        token = tokens.setdefault(id(groups[i]), len(tokens))
        group_of[token] = groups[i]
        rank = ranks.setdefault(token, dist.get_rank(groups[i]))
        want = local_shape(full_shapes[i], worlds[i], rank)
        if tuple(shards[i].shape) != want:
            raise ValueError(
                f"shard {i} has shape {tuple(shards[i].shape)} but chunk {rank} of {worlds[i]} of "
                f"{tuple(full_shapes[i])} is {want}; shards must be torch.chunk(full, {worlds[i]}, dim=0)[{rank}]"
            )
        signature.append((tuple(full_shapes[i]), split_key(splits[i]), token, worlds[i], configs[i]))
    schedules = _schedules(tuple(signature), tuple(sorted(ranks.items())), max_bucket_numel)

    outs: list[Optional[Tensor]] = [None] * count
    mats = [as_matrices(shards[i]) for i in dist_items]
    for i in dist_items:
        outs[i] = torch.empty(shards[i].shape, dtype=configs[i].dtype, device=shards[i].device)
    out_mats = [as_matrices(outs[i]) for i in dist_items]
    device = shards[dist_items[0]].device if dist_items else None
    runs = [_BucketRun(s, group_of[s.group], mats, out_mats, device) for s in schedules]

    for run in runs[:prefetch]:
        run.start_gather()
    local_outs = orthogonalize_local(  # unsharded tensors: computed while the first gathers fly
        [shards[i] for i in local_items], [splits[i] for i in local_items], [configs[i] for i in local_items]
    )
    for i, o in zip(local_items, local_outs):
        outs[i] = o
    for k, run in enumerate(runs):
        if k + prefetch < len(runs):
            runs[k + prefetch].start_gather()
        run.compute()
    for run in runs:
        run.finish()
    return outs


# ---------------------------------------------------------------- optimizer


def dtensor_layout(p) -> ShardLayout:
    """ShardLayout of an FSDP2 / HSDP DTensor: Shard(0) on at most one mesh dim."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = [d for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if not shard_dims:
        return ShardLayout(tuple(p.shape), None)
    pl = p.placements[shard_dims[0]]
    if len(shard_dims) > 1 or type(pl) is not Shard or pl.dim != 0:
        raise ValueError(
            f"ShardedMuon supports DTensors sharded as Shard(0) on one mesh dim (FSDP2/HSDP); got placements "
            f"{p.placements} for shape {tuple(p.shape)}; flatten the FSDP mesh dims into one"
        )
    return ShardLayout(tuple(p.shape), p.device_mesh.get_group(shard_dims[0]))


class ShardedMuon(Muon):
    """Muon on FSDP2 DTensor parameters or on plain tensors with a ShardLayout.

    Same keywords and param-group options as `Muon`, plus:
      shard_layouts: {param: ShardLayout} for plain-tensor shards; plain
        tensors not listed are whole on this rank (e.g. EP-local experts).
      max_bucket_numel, prefetch: see `sharded_orthogonalize`.
    Momentum buffers are DTensors like their parameters, so
    torch.distributed.checkpoint (get/set_optimizer_state_dict) saves and
    reshards them.
    """

    def __init__(
        self,
        params,
        *args,
        shard_layouts: Optional[Mapping[Tensor, ShardLayout]] = None,
        max_bucket_numel: int = DEFAULT_MAX_BUCKET_NUMEL,
        prefetch: int = 2,
        **kwargs,
    ) -> None:
        self._layouts = dict(shard_layouts or {})
        self._max_bucket_numel, self._prefetch = max_bucket_numel, prefetch
        super().__init__(params, *args, **kwargs)

    def _layout(self, p: Tensor) -> ShardLayout:
        layout = self._layouts.get(p)
        if layout is None:  # found once per parameter, then kept
            layout = dtensor_layout(p) if hasattr(p, "device_mesh") else ShardLayout(tuple(p.shape), None)
            self._layouts[p] = layout
        return layout

    def _local(self, t: Tensor) -> Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def _full_shape(self, p: Tensor) -> tuple[int, ...]:
        return self._layout(p).full_shape

    def _box(self, p: Tensor) -> Box:
        layout = self._layout(p)
        if layout.group is None:
            return full_box(layout.full_shape)
        return shard_box(layout.full_shape, dist.get_world_size(layout.group), dist.get_rank(layout.group))

    def _orthogonalize(self, params, updates, splits, configs) -> list[Tensor]:
        layouts = [self._layout(p) for p in params]
        return sharded_orthogonalize(
            updates,
            [lay.full_shape for lay in layouts],
            [lay.group for lay in layouts],
            splits,
            config=configs,
            max_bucket_numel=self._max_bucket_numel,
            prefetch=self._prefetch,
        )
