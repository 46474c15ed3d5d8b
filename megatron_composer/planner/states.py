"""Bytes of parameters, gradients and optimizer state on one rank: exact, from shapes.

What the trainer allocates (`parallel.parallelize`, `optim.build_optimizer`):

* ddp: whole parameters (the rank's E/EP routed experts), fp32, or bf16 with
  fp32 main copies under --bf16; fp32 `main_grad` buffers (megatron-core DDP
  with `grad_reduce_in_fp32`, unpadded without its distributed optimizer);
* hsdp: fp32 FSDP2 shards (they are the main weights, with or without
  --bf16) and fp32 gradient shards, both padded (below);
* optimizer state over the main weights: AdamW 2 fp32 tensors per
  parameter, Muon 1 (momentum) per Muon matrix (`optim.param_groups`'s rule
  says which), over the unpadded local shards under hsdp.

HSDP shards every tensor along dim 0 like `torch.chunk`: dense tensors over
`dense_shard_size` consecutive ranks, routed experts over the
expert-data-parallel ranks (world / EP, stride EP). FSDP2 allocates each
parameter shard padded to the first chunk's size (ceil(d0 / S) rows) and its
gradient as a view into one padded reduce-scatter output per unit, while
`torch.zeros_like` gives the optimizer state the unpadded local size. So
ranks differ only in the optimizer state, and rank 0, which holds chunk 0
(the largest) of every tensor, holds the most: the planner reports rank 0.

Not counted: AdamW's `step` counters (one 0-dim tensor per parameter, on the
host), the router's expert-bias and token-count buffers (2 x E fp32 per MoE
layer), RoPE caches.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional, Sequence

from ..config.model import ModelConfig, ParamEntry
from ..optim.param_groups import HeadGeometry, muon_split

SHARDINGS = ("ddp", "hsdp")


def default_dense_shard_size(world_size: int, cp: int) -> int:
    """`parallel.parallelize`'s default when --dense-shard-size is not given."""
    return max(cp, min(world_size, 2))


@dataclass(frozen=True)
class StateBytes:
    parameters: int
    main_weights: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.main_weights + self.gradients + self.optimizer_state


def chunk_rows(size: int, world: int, index: int) -> int:
    """Rows of dim-0 chunk `index` of `size` rows split like torch.chunk(.., world) (0 past the end)."""
    step = -(-size // world) if size else 0
    lo = min(index * step, size)
    return min(lo + step, size) - lo


def shard_indices(rank: int, world_size: int, ep: int, dense_shard_size: int) -> tuple[int, int]:
    """(index in the dense shard group, index in the expert-data-parallel group) of `rank`.

    Dense shard groups are consecutive ranks (`parallel.fsdp.dense_mesh`); an
    EDP group is the ranks with the same rank % EP (`parallel.fsdp.expert_mesh`).
    """
    return rank % dense_shard_size, rank // ep


def optimizer_kinds(inventory: Sequence[ParamEntry], c: ModelConfig, optimizer: str,
                    granularity: str = "head") -> list[str]:
    """"muon" or "adamw" per parameter, by the optimizer's own rule (`optim.param_groups.muon_split`)."""
    if optimizer == "adam":
        return ["adamw"] * len(inventory)
    geometry = HeadGeometry.from_config(c)
    return [muon_split(p.name, p.shape, geometry, granularity)[0] for p in inventory]


def state_bytes(inventory: Sequence[ParamEntry], c: ModelConfig, *, sharding: str, world_size: int, ep: int,
                dense_shard_size: Optional[int] = None, cp: int = 1, optimizer: str = "adam",
                bf16: bool = False, granularity: str = "head", rank: int = 0) -> StateBytes:
    """Exact bytes that `rank` allocates for parameters, fp32 main weights, gradients and optimizer state."""
    if sharding not in SHARDINGS:
        raise ValueError(f"--data-parallel-sharding {sharding!r}; use one of {', '.join(SHARDINGS)}")
    kinds = optimizer_kinds(inventory, c, optimizer, granularity)
    state_per_element = {"adamw": 8, "muon": 4}
    if sharding == "ddp":
        numel = sum(p.numel for p in inventory)
        return StateBytes(parameters=numel * (2 if bf16 else 4), main_weights=numel * 4 if bf16 else 0,
                          gradients=numel * 4,
                          optimizer_state=sum(p.numel * state_per_element[k] for p, k in zip(inventory, kinds)))
    shard = dense_shard_size or default_dense_shard_size(world_size, cp)
    edp = world_size // ep
    dense_index, expert_index = shard_indices(rank, world_size, ep, shard)
    padded = unpadded_state = 0
    for p, kind in zip(inventory, kinds):
        world, index = (edp, expert_index) if p.expert else (shard, dense_index)
        rest = prod(p.shape[1:])
        padded += -(-p.shape[0] // world) * rest
        unpadded_state += chunk_rows(p.shape[0], world, index) * rest * state_per_element[kind]
    return StateBytes(parameters=padded * 4, main_weights=0, gradients=padded * 4, optimizer_state=unpadded_state)
