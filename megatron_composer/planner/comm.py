"""Bytes each GPU sends per optimizer step, collective by collective.

Volumes are what one GPU puts on the wire with ring / pairwise algorithms
(all-gather and reduce-scatter of B bytes over n ranks: (n-1)/n x B;
all-reduce: 2 (n-1)/n x B; all-to-all: the share addressed to other ranks),
derived from what the trainer runs:

* HSDP (torch FSDP2, `parallel.fsdp`): per micro-batch, every unit is
  all-gathered in the compute dtype and its gradients reduce-scattered in
  fp32 (dense units' also all-reduced in fp32 across the replicas of the
  shard group). The routed experts are all-gathered twice, in forward and
  again in backward; the dense units once: each is its own FSDP2 root (no
  `fully_shard` on the whole model), and FSDP2 keeps a root's parameters
  unsharded from its forward to its backward, except that the output
  layer, run once per head, is resharded after each head's backward and
  gathered again for the next (MTP depth times more);
* DDP (megatron-core): the fp32 gradient buffers all-reduced once per step,
  dense over DP x CP, experts over EDP (with `--overlap-grad-reduce` one
  all-reduce per bucket, the same bytes);
* EP all-to-all (megatron-core's alltoall dispatcher, per MoE layer and
  micro-batch): dispatch in MXFP8 (1 + 1/32 bytes per element) or the compute
  dtype, fp32 routing probabilities, combine in the compute dtype; backward
  sends the same volumes unquantized; recompute repeats the forward's;
* CP latent all-gather (`attention.cp`, per layer and micro-batch): each rank
  sends its kv_lora + rope latents to the other CP ranks, backward
  reduce-scatters their gradients;
* Muon (`optim.sharded_muon`, HSDP only): the all-to-alls that assemble whole
  blocks on their owners and send the orthogonalized pieces back, in bf16,
  from the optimizer's own plan (`plan_buckets`); under DDP each replica
  orthogonalizes its whole matrices and sends nothing.

A collective runs at NVLink bandwidth when its group lies inside one NVLink
domain, else at the per-GPU InfiniBand bandwidth (the bottleneck of a
hierarchical algorithm). Small collectives (loss counts, the gradient norm,
expert-bias token counts) are left out.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from ..config.model import ModelConfig, ParamEntry
from ..optim.muon import NewtonSchulzConfig
from ..optim.param_groups import HeadGeometry, muon_split
from ..optim.sharded_muon import plan_buckets


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step, as seen by one GPU."""

    name: str
    group: str  # which ranks, e.g. "EP=8"
    group_size: int
    inter_node: bool  # crosses an NVLink domain: runs at InfiniBand bandwidth
    bytes_per_step: int
    overlapped: bool  # runs on its own stream beside compute (else on the critical path)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def crosses_domain(ranks: Sequence[int], domain: int) -> bool:
    return len({r // domain for r in ranks}) > 1


def unit_sizes(inventory: Sequence[ParamEntry]) -> dict[str, tuple[int, bool]]:
    """FSDP2 unit -> (elements, expert unit?)."""
    units: dict[str, list] = {}
    for p in inventory:
        u = units.setdefault(p.unit, [0, p.expert])
        u[0] += p.numel
    return {k: (v[0], v[1]) for k, v in units.items()}


def muon_all_to_all_bytes(inventory: Sequence[ParamEntry], c: ModelConfig, *, dense_shard_size: int, edp: int,
                          granularity: str = "head") -> tuple[int, int]:
    """(dense, expert) bytes the busiest rank sends in one ShardedMuon step: its pieces of
    blocks other ranks own, and the orthogonalized pieces of its own blocks sent back."""
    geometry = HeadGeometry.from_config(c)
    shapes, splits, groups, worlds = [], [], [], []
    for p in inventory:
        kind, split = muon_split(p.name, p.shape, geometry, granularity)
        if kind == "muon":
            shapes.append(p.shape)
            splits.append(split)
            groups.append("experts" if p.expert else "dense")
            worlds.append(edp if p.expert else dense_shard_size)
    if not shapes:
        return 0, 0
    cfg = NewtonSchulzConfig()  # pieces travel in the Newton-Schulz dtype
    sent: dict[str, list[int]] = {"dense": [0] * dense_shard_size, "experts": [0] * edp}
    for bucket in plan_buckets(shapes, splits, groups, worlds, [cfg] * len(shapes)):
        n = bucket.shape[1]
        for e in bucket.entries:
            for q, lo, hi in e.pieces:
                if q != e.owner:
                    sent[bucket.group][q] += (hi - lo) * n
                    sent[bucket.group][e.owner] += (hi - lo) * n
    return cfg.dtype.itemsize * max(sent["dense"]), cfg.dtype.itemsize * max(sent["experts"])


@dataclass(frozen=True)
class CommSetup:
    world_size: int
    cp: int
    ep: int
    sharding: str
    dense_shard_size: int
    micro_batches: int  # per step on one DP rank
    tokens: int  # per micro-batch on one rank
    a: int  # compute-dtype bytes
    nvlink_domain: int
    moe_dispatch_precision: str = "bf16"
    optimizer: str = "adam"
    muon_granularity: str = "head"
    moe_recomputed: bool = False  # full recompute or selective "moe": the forward all-to-alls run twice
    attention_recomputed: bool = False  # full recompute: the latent all-gather runs twice


def collectives(c: ModelConfig, inventory: Sequence[ParamEntry], s: CommSetup) -> list[Collective]:
    """Every collective of one step on rank 0 (module docstring)."""
    out: list[Collective] = []
    world, dom = s.world_size, s.nvlink_domain
    edp = world // s.ep
    expert_group = list(range(0, world, s.ep))
    if s.sharding == "hsdp":
        shard = s.dense_shard_size
        replicas = world // shard
        units = unit_sizes(inventory)
        dense = sum(n for n, e in units.values() if not e)
        experts = sum(n for n, e in units.values() if e)
        regathered = c.mtp_num_layers * units.get("output_layer", (0, False))[0]
        for label, numel, size, ranks in (("dense", dense, shard, list(range(shard))),
                                          ("expert", experts, edp, expert_group)):
            if size == 1 or not numel:
                continue
            inter = crosses_domain(ranks, dom)
            group = f"{'dense shard' if label == 'dense' else 'EDP'}={size}"
            gathered, name = (dense + regathered, "dense") if label == "dense" else (2 * experts, "expert, fwd + bwd")
            out.append(Collective(f"FSDP all-gather ({name})", group, size, inter,
                                  int(s.micro_batches * _ring(size) * gathered * s.a), True))
            out.append(Collective(f"FSDP reduce-scatter ({label} grads)", group, size, inter,
                                  int(s.micro_batches * _ring(size) * numel * 4), True))
        if replicas > 1 and dense:
            out.append(Collective("HSDP replica all-reduce (dense grads)", f"replicas={replicas}", replicas,
                                  crosses_domain(list(range(0, world, shard)), dom),
                                  int(s.micro_batches * 2 * _ring(replicas) * dense / shard * 4), True))
    else:
        units = unit_sizes(inventory)
        dense = sum(n for n, e in units.values() if not e)
        experts = sum(n for n, e in units.values() if e)
        out.append(Collective("DDP all-reduce (dense grads)", f"DPxCP={world}", world,
                              crosses_domain(list(range(world)), dom), int(2 * _ring(world) * dense * 4), False))
        if experts and edp > 1:
            out.append(Collective("DDP all-reduce (expert grads)", f"EDP={edp}", edp,
                                  crosses_domain(expert_group, dom), int(2 * _ring(edp) * experts * 4), False))
    moe_layers = c.num_moe_layers + (c.mtp_num_layers if c.num_moe_layers else 0)
    if s.ep > 1 and moe_layers:
        routed = s.tokens * c.moe_router_topk
        payload = (1 + 1 / 32) if s.moe_dispatch_precision == "mxfp8" else s.a
        forward = routed * (c.hidden_size * payload + 4 + c.hidden_size * s.a)  # dispatch + probs, combine
        backward = routed * (2 * c.hidden_size * s.a + 4)
        per_layer = _ring(s.ep) * (forward * (2 if s.moe_recomputed else 1) + backward)
        inter = crosses_domain(list(range(s.ep)), dom)
        out.append(Collective(f"EP all-to-all (dispatch {s.moe_dispatch_precision}, combine bf16)",
                              f"EP={s.ep}", s.ep, inter, int(s.micro_batches * moe_layers * per_layer), False))
    if s.cp > 1:
        layers = c.num_layers + c.mtp_num_layers
        latent = s.tokens * (c.kv_lora_rank + c.qk_pos_emb_head_dim) * s.a
        passes = 3 if s.attention_recomputed else 2  # forward gather (+ recompute) + backward reduce-scatter
        out.append(Collective("CP latent all-gather (+ bwd reduce-scatter)", f"CP={s.cp}", s.cp,
                              crosses_domain(list(range(s.cp)), dom),
                              int(s.micro_batches * layers * passes * (s.cp - 1) * latent), True))
    if s.optimizer == "muon" and s.sharding == "hsdp":
        dense_bytes, expert_bytes = muon_all_to_all_bytes(inventory, c, dense_shard_size=s.dense_shard_size,
                                                          edp=edp, granularity=s.muon_granularity)
        for label, nbytes, size, ranks in (("dense", dense_bytes, s.dense_shard_size, list(range(s.dense_shard_size))),
                                           ("expert", expert_bytes, edp, expert_group)):
            if nbytes:
                group = f"{'dense shard' if label == 'dense' else 'EDP'}={size}"
                out.append(Collective(f"Muon all-to-all ({label}: to owners + back)", group, size,
                                      crosses_domain(ranks, dom), nbytes, False))
    return out


def newton_schulz_flops(inventory: Sequence[ParamEntry], c: ModelConfig, granularity: str = "head",
                        steps: int = 5) -> tuple[float, float]:
    """(dense, expert) FLOPs of one Newton-Schulz pass over every Muon block of these parameters:
    per [m, n] block (m <= n) and iteration, X X^T, A A and (bA + cA^2) X: 4 m^2 n + 2 m^3."""
    from ..optim.muon import matrix_blocks

    geometry = HeadGeometry.from_config(c)
    per_shape: dict[tuple[bool, tuple[int, int]], int] = defaultdict(int)
    for p in inventory:
        kind, split = muon_split(p.name, p.shape, geometry, granularity)
        if kind == "muon":
            for blk in matrix_blocks(p.shape, split):
                per_shape[(p.expert, blk.shape)] += 1
    flops = [0.0, 0.0]
    for (expert, (m, n)), count in per_shape.items():
        m, n = min(m, n), max(m, n)
        flops[expert] += count * steps * (4 * m * m * n + 2 * m ** 3)
    return flops[0], flops[1]
