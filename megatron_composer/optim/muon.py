"""Muon: Newton-Schulz orthogonalized momentum, per matrix, per head, per expert.

The algorithm is `torch.optim.Muon`'s (PyTorch >= 2.9), step for step:

    B <- lerp(B, g, 1 - mu)                    EMA momentum buffer
    U <- lerp(g, B, mu) if nesterov else B
    O <- NS(U)                                 quintic Newton-Schulz
    theta <- theta * (1 - lr * wd)             decoupled weight decay
    theta <- theta - adjust_lr(lr, shape(O)) * O

With whole 2-D matrices and `ns_dtype=torch.bfloat16` the updates are the
same bits as torch.optim.Muon (tests/test_muon.py checks this).

Departures, all opt-in through a param group's "split" (Composer 2.5 runs
Newton-Schulz per attention head and per expert):

- A matrix can be orthogonalized as a grid of sub-matrices ("blocks"): row
  blocks (one per query head), column blocks (one per head of the output
  projection), or both. `split` is plain data so it survives `state_dict()`
  and `torch.load(weights_only=True)`:
      None                        every [m, n] matrix whole
      {"rows": k}                 k equal row blocks
      {"rows": [s0, s1, ...]}     row blocks of those sizes (e.g. K, V of each head)
      {"cols": ...}, both keys    column blocks, or the grid of both.
- A parameter with more than 2 dims is a stack of matrices ([E, m, n]
  experts): every trailing [m, n] matrix is orthogonalized on its own.
- adjust_lr_fn is evaluated on the shape of the block actually
  orthogonalized, not the parameter: "match_rms_adamw" exists to give the
  orthogonal update RMS 0.2, and an orthogonalized [A, B] block has RMS
  1/sqrt(max(A, B)) whatever parameter it lives in; "original" likewise
  corrects the aspect ratio of the matrix that was orthogonalized.
- `ns_dtype` picks the Newton-Schulz compute dtype (float32 for exactness).

Same-shape blocks are stacked and orthogonalized by one batched
Newton-Schulz. `sharded_muon.ShardedMuon` subclasses `Muon` and replaces only
`_orthogonalize` (and how it finds a tensor's local shard); momentum, weight
decay and lr scaling are the functions in this file.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7

Split = Optional[Mapping[str, Union[int, Sequence[int]]]]


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximate U V^T of each matrix G = U S V^T with a quintic iteration.

    G: [..., m, n], any float dtype; leading dims are a batch of independent
    matrices. Returns [..., m, n] in `dtype`. Each matrix is divided by its
    Frobenius norm (clamped at eps), transposed to wide when m > n, then
    X <- a X + (b A + c A A) X with A = X X^T, `steps` times. The op order is
    torch.optim.Muon's (addmm / baddbmm), so bf16 results match it bit for
    bit. G is never written to.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs [..., m, n], got shape {tuple(G.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"ns coefficients must be (a, b, c), got {coefficients}")
    a, b, c = coefficients
    batch_shape, (m, n) = G.shape[:-2], G.shape[-2:]
    X = G.to(dtype)
    if X.ndim > 3:
        X = X.reshape(-1, m, n)
    tall = m > n
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    if X.ndim == 2:
        for _ in range(steps):
            gram = X @ X.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            X = torch.addmm(X, poly, X, beta=a)
    else:
        for _ in range(steps):
            gram = X @ X.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            X = torch.baddbmm(X, poly, X, beta=a)
    if tall:
        X = X.mT
    return X.reshape(*batch_shape, m, n)


@dataclass(frozen=True)
class NewtonSchulzConfig:
    """The Newton-Schulz settings of one param group (hashable: a bucket key)."""

    steps: int = DEFAULT_NS_STEPS
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS
    eps: float = DEFAULT_EPS
    dtype: torch.dtype = torch.bfloat16

    def __call__(self, G: Tensor) -> Tensor:
        return newton_schulz(G, self.steps, self.coefficients, self.eps, self.dtype)


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """torch.optim.Muon's lr adjustment for an orthogonalized [A, B] matrix."""
    A, B = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} is not one of None, 'original', 'match_rms_adamw'")


def momentum_update(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Advance the EMA momentum buffer in place; return the matrix to orthogonalize.

    grad, buf: same shape and dtype. The result aliases `buf` when nesterov
    is off, so callers must not write to it.
    """
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


# ---------------------------------------------------------------- block layout


class Block(NamedTuple):
    """One orthogonalized sub-matrix of a parameter viewed as [B, m, n]."""

    batch: int
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])


def _sizes(total: int, spec, axis: str, shape) -> tuple[int, ...]:
    if spec is None:
        return (total,)
    if isinstance(spec, int):
        if spec < 1 or total % spec:
            raise ValueError(
                f"split {axis}={spec} does not divide the {total} {axis} of shape {tuple(shape)}; "
                f"give explicit block sizes as a list, e.g. {{'{axis}': [..]}}"
            )
        return (total // spec,) * spec
    sizes = tuple(int(s) for s in spec)
    if sum(sizes) != total or min(sizes) < 1:
        raise ValueError(
            f"split {axis} sizes {list(sizes)} must be positive and sum to {total} for shape {tuple(shape)}"
        )
    return sizes


@lru_cache(maxsize=4096)
def _grid_cached(shape: tuple[int, ...], rows, cols) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _sizes(shape[-2], rows, "rows", shape), _sizes(shape[-1], cols, "cols", shape)


def _freeze(spec):
    return spec if spec is None or isinstance(spec, int) else tuple(spec)


def split_key(split: Split) -> tuple:
    """A hashable form of a split (for caches and grouping)."""
    split = split or {}
    return (_freeze(split.get("rows")), _freeze(split.get("cols")))


def split_grid(shape: Sequence[int], split: Split) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(row block sizes, column block sizes) of each [m, n] matrix of `shape`."""
    if len(shape) < 2:
        raise ValueError(f"Muon orthogonalizes matrices; shape {tuple(shape)} has fewer than 2 dims (use AdamW)")
    split = split or {}
    extra = set(split) - {"rows", "cols"}
    if extra:
        raise ValueError(f"unknown split keys {sorted(extra)}; a split has 'rows' and/or 'cols'")
    return _grid_cached(tuple(shape), _freeze(split.get("rows")), _freeze(split.get("cols")))


def num_matrices(shape: Sequence[int]) -> int:
    """Number of [m, n] matrices in a tensor of `shape` (product of leading dims)."""
    return math.prod(shape[:-2])


def as_matrices(t: Tensor) -> Tensor:
    """View a [..., m, n] tensor as [B, m, n] (copies only if non-contiguous)."""
    return t.reshape(num_matrices(t.shape), t.shape[-2], t.shape[-1])


def matrix_blocks(shape: Sequence[int], split: Split) -> list[Block]:
    """All blocks of a tensor of `shape`, batch-major, then rows, then cols."""
    rows, cols = split_grid(shape, split)
    row_edges = [0, *accumulate(rows)]
    col_edges = [0, *accumulate(cols)]
    return [
        Block(b, (row_edges[i], row_edges[i + 1]), (col_edges[j], col_edges[j + 1]))
        for b in range(num_matrices(shape))
        for i in range(len(rows))
        for j in range(len(cols))
    ]


def is_uniform(grid: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    rows, cols = grid
    return len(set(rows)) == 1 and len(set(cols)) == 1


def grid_view(mats: Tensor, grid) -> Tensor:
    """[B, m, n] contiguous -> [B, R, C, m/R, n/C] view of a uniform grid's blocks."""
    rows, cols = grid
    return mats.view(mats.shape[0], len(rows), rows[0], len(cols), cols[0]).transpose(2, 3)


# ---------------------------------------------------------------- update rule

Box = tuple[int, int, int, int]  # (batch_lo, batch_hi, row_lo, row_hi) of [B, m, n]


def full_box(shape: Sequence[int]) -> Box:
    return (0, num_matrices(shape), 0, shape[-2])


def lr_regions(
    full_shape: Sequence[int], split: Split, box: Box, lr: float, adjust_lr_fn: Optional[str]
) -> list[tuple[Optional[tuple[int, slice, slice]], float]]:
    """Adjusted lr of each part of the local tensor (the `box` of the full [B, m, n]).

    One `(None, lr)` region when every block has the same adjusted lr (the
    common case: whole matrices, equal heads); otherwise one region per
    block that intersects the box, indexed in local [B_local, m_local, n]
    coordinates.
    """
    grid = split_grid(full_shape, split)
    shapes = {(r, c) for r in grid[0] for c in grid[1]}
    values = {s: adjusted_lr(lr, adjust_lr_fn, s) for s in shapes}
    if len(set(values.values())) == 1:
        return [(None, next(iter(values.values())))]
    b0, b1, r0, r1 = box
    regions = []
    for blk in matrix_blocks(full_shape, split):
        lo, hi = max(blk.rows[0], r0), min(blk.rows[1], r1)
        if b0 <= blk.batch < b1 and lo < hi:
            index = (blk.batch - b0, slice(lo - r0, hi - r0), slice(*blk.cols))
            regions.append((index, values[blk.shape]))
    return regions


def apply_update(param: Tensor, update: Tensor, lr: float, weight_decay: float, regions) -> None:
    """theta *= 1 - lr*wd; theta -= adjusted_lr * O, region by region (in place).

    param: local tensor [..., m, n]; update: same shape, any float dtype.
    """
    param.mul_(1 - lr * weight_decay)
    if len(regions) == 1 and regions[0][0] is None:
        param.add_(update, alpha=-regions[0][1])
        return
    p3, u3 = as_matrices(param), as_matrices(update)
    if p3.data_ptr() != param.data_ptr() or not param.is_contiguous():
        raise ValueError("per-block lr regions need a contiguous parameter")
    for index, alr in regions:
        p3[index].add_(u3[index], alpha=-alr)


def orthogonalize_local(
    updates: Sequence[Tensor], splits: Sequence[Split], configs: Sequence[NewtonSchulzConfig]
) -> list[Tensor]:
    """Orthogonalize every block of every whole tensor, batching same-shape blocks.

    updates[i]: [..., m, n] (whole matrices, not shards); returns a list of
    tensors of the same shapes in configs[i].dtype.
    """
    outs = [torch.empty(u.shape, dtype=cfg.dtype, device=u.device) for u, cfg in zip(updates, configs)]
    buckets: dict = defaultdict(list)  # (block shape, cfg) -> [(item, blocks | None)]
    for i, (u, split, cfg) in enumerate(zip(updates, splits, configs)):
        grid = split_grid(u.shape, split)
        if is_uniform(grid):
            buckets[((grid[0][0], grid[1][0]), cfg)].append((i, None))
            continue
        by_shape = defaultdict(list)
        for blk in matrix_blocks(u.shape, split):
            by_shape[blk.shape].append(blk)
        for shape, blocks in by_shape.items():
            buckets[(shape, cfg)].append((i, blocks))

    for (shape, cfg), members in buckets.items():
        counts = [_num_blocks(updates[i].shape, splits[i]) if blocks is None else len(blocks)
                  for i, blocks in members]
        stacked = torch.empty(sum(counts), *shape, dtype=cfg.dtype, device=updates[members[0][0]].device)
        for (i, blocks), part in zip(members, stacked.split(counts)):
            mats = as_matrices(updates[i])
            if blocks is None:
                grid = split_grid(updates[i].shape, splits[i])
                part.view(mats.shape[0], len(grid[0]), len(grid[1]), *shape).copy_(
                    grid_view(mats.contiguous(), grid)
                )
            else:
                for k, blk in enumerate(blocks):
                    part[k].copy_(mats[blk.batch, slice(*blk.rows), slice(*blk.cols)])
        result = cfg(stacked)
        for (i, blocks), part in zip(members, result.split(counts)):
            out = as_matrices(outs[i])
            if blocks is None:
                grid = split_grid(updates[i].shape, splits[i])
                grid_view(out, grid).copy_(part.view(out.shape[0], len(grid[0]), len(grid[1]), *shape))
            else:
                for k, blk in enumerate(blocks):
                    out[blk.batch, slice(*blk.rows), slice(*blk.cols)].copy_(part[k])
    return outs


def _num_blocks(shape, split) -> int:
    rows, cols = split_grid(shape, split)
    return num_matrices(shape) * len(rows) * len(cols)


# ---------------------------------------------------------------- optimizer


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon with per-head / per-expert splits and a choice of NS dtype.

    Constructor keywords mean what they mean in torch.optim.Muon; in addition
    `ns_dtype` (Newton-Schulz compute dtype) and, per param group, `split`
    (see the module docstring). Parameters must have >= 2 dims; more than 2
    means a stack of matrices.

        opt = Muon([{"params": [q_up], "split": {"rows": num_heads}},
                    {"params": [fc2, eh_proj]}], lr=0.02)
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} is not one of None, 'original', 'match_rms_adamw'")
        if not 0 < ns_steps < 100:
            raise ValueError(f"ns_steps={ns_steps} must be in [1, 99]")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            split=None,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if torch.is_complex(p):
                raise ValueError("Muon does not support complex parameters")
            split_grid(self._full_shape(p), group["split"])  # raises on a bad split

    # How a parameter is laid out; ShardedMuon overrides these three.
    def _local(self, t: Tensor) -> Tensor:
        if hasattr(t, "to_local"):
            raise TypeError("Muon got a DTensor (FSDP2) parameter; use sharded_muon.ShardedMuon")
        return t

    def _full_shape(self, p: Tensor) -> tuple[int, ...]:
        self._local(p)  # refuses DTensors at construction already
        return tuple(p.shape)

    def _box(self, p: Tensor) -> Box:
        return full_box(p.shape)

    def _orthogonalize(self, params, updates, splits, configs) -> list[Tensor]:
        return orthogonalize_local(updates, splits, configs)

    @staticmethod
    def ns_config(group: Mapping) -> NewtonSchulzConfig:
        return NewtonSchulzConfig(group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"], group["ns_dtype"])

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (group, param, update to orthogonalize)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                update = momentum_update(
                    self._local(p.grad), self._local(state["momentum_buffer"]), group["momentum"], group["nesterov"]
                )
                work.append((group, p, update))
        if not work:
            return loss
        ortho = self._orthogonalize(
            [p for _, p, _ in work],
            [u for _, _, u in work],
            [g["split"] for g, _, _ in work],
            [self.ns_config(g) for g, _, _ in work],
        )
        for (group, p, _), o in zip(work, ortho):
            lr = float(group["lr"])
            regions = lr_regions(self._full_shape(p), group["split"], self._box(p), lr, group["adjust_lr_fn"])
            apply_update(self._local(p), o, lr, group["weight_decay"], regions)
        return loss
