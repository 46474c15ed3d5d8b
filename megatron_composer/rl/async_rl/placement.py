"""Where the async RL services run: a Ray placement group per GPU role, checked against the cluster first.

Three roles hold a model on a device: the trainer ranks (`--trainer-ranks`),
the inference workers (`--inference-workers`) and the evaluator (on with
`--eval-tasks` and an environment with held-out tasks). When the Ray cluster
has GPUs, each of their actors gets one GPU of its own:

1. `ServiceLayout.of` counts the actors per role from the flags, before any
   actor exists;
2. `plan_placement` checks the count against the cluster's GPUs (total and
   free) and raises `PlacementError` naming both when the layout does not fit,
   before any worker starts (Ray would otherwise wait forever for a placement
   group that cannot be placed);
3. `reserve` makes one placement group per role, one `{"GPU": 1}` bundle per
   actor, PACKed: a role's actors share as few nodes as possible (the
   trainer ranks' NCCL traffic stays within a node where it can);
4. `actor_options` places actor i of a role in bundle i of its group.

Ray then sets each actor's CUDA_VISIBLE_DEVICES to its one GPU, so the
process sees a single device, cuda:0, whatever its trainer rank:
`local_gpu_index` turns Ray's assignment into that local index (LOCAL_RANK),
and the global rank stays the rank in the trainer's torch.distributed group.

A cluster without GPUs runs every service on CPU (gloo), unplaced, as Ray
schedules it; the environment workers never hold a GPU. To run on CPU on a
machine with GPUs, start Ray without them (`ray start --num-gpus 0`, or
CUDA_VISIBLE_DEVICES= for this job's own Ray instance).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

ROLES = ("trainer", "inference", "evaluator")
# the flag that sets each role's count (named in errors)
_FLAGS = {"trainer": "--trainer-ranks", "inference": "--inference-workers", "evaluator": "--eval-tasks 0 turns it off"}


class PlacementError(ValueError):
    """The Ray cluster cannot hold the services' layout."""


@dataclasses.dataclass(frozen=True)
class ServiceLayout:
    """Actors per role that each hold a model (one GPU each when the run uses GPUs)."""

    trainer: int
    inference: int
    evaluator: int  # 0 or 1

    @classmethod
    def of(cls, async_config, *, evaluator: bool) -> "ServiceLayout":
        """From the `--async-rl` flags; an external `--rollout-server` replaces the inference workers."""
        inference = 0 if async_config.rollout_server else async_config.inference_workers
        return cls(async_config.trainer_ranks, inference, int(evaluator))

    def count(self, role: str) -> int:
        return getattr(self, role)

    @property
    def total(self) -> int:
        return sum(self.count(r) for r in ROLES)

    def describe(self) -> str:
        return ", ".join(f"{self.count(r)} {r} ({_FLAGS[r]})" for r in ROLES if self.count(r))


@dataclasses.dataclass(frozen=True)
class Placement:
    """How the services are placed: one GPU per actor of each role, or (no GPU in the cluster) on CPU."""

    layout: ServiceLayout
    gpus: bool


def plan_placement(layout: ServiceLayout, cluster: Mapping[str, float],
                   available: Optional[Mapping[str, float]] = None) -> Placement:
    """The placement of `layout` on a Ray cluster of `cluster` resources (`ray.cluster_resources()`),
    `available` of them free (`ray.available_resources()`; default: all); PlacementError when it
    has GPUs but too few free for one per actor."""
    total = int(cluster.get("GPU", 0))
    if total == 0:
        return Placement(layout, gpus=False)
    free = int((cluster if available is None else available).get("GPU", 0))
    if layout.total > free:
        raise PlacementError(
            f"the async RL services need {layout.total} GPUs, one per actor: {layout.describe()}; the Ray "
            f"cluster has {total} GPUs, {free} of them free. Lower --trainer-ranks or --inference-workers, "
            f"turn the evaluator off with --eval-tasks 0, or add GPUs to the cluster; to run on CPU, start "
            f"Ray without GPUs (ray start --num-gpus 0, or CUDA_VISIBLE_DEVICES= for this job's own Ray)")
    return Placement(layout, gpus=True)


def reserve(ray, placement: Placement, timeout_s: float = 120.0) -> dict:
    """{role: placement group} of one {"GPU": 1} bundle per actor, ready (none on CPU)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if not placement.gpus:
        return {}
    groups = {}
    for role in ROLES:
        n = placement.layout.count(role)
        if n:
            groups[role] = placement_group([{"GPU": 1}] * n, strategy="PACK")
    ready, _ = ray.wait([g.ready() for g in groups.values()], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        for g in groups.values():
            remove_placement_group(g)
        raise PlacementError(f"Ray could not place {placement.layout.describe()} on one GPU each within "
                             f"{timeout_s:g} s (another job took GPUs meanwhile?)")
    return groups


def release(groups: Mapping) -> None:
    from ray.util.placement_group import remove_placement_group

    for g in groups.values():
        remove_placement_group(g)


def actor_options(groups: Mapping, role: str, index: int) -> dict:
    """`ray.remote` options for actor `index` of `role`: its GPU bundle, or CPU only when unplaced."""
    if role not in groups:
        return {"num_gpus": 0}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_gpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        groups[role], placement_group_bundle_index=index)}


def local_gpu_index(assigned: Sequence, visible: Optional[str]) -> int:
    """This process's local CUDA device index (its LOCAL_RANK) from the GPU ids Ray assigned it
    (`ray.get_gpu_ids()`) and CUDA_VISIBLE_DEVICES: 0 where Ray narrowed the visible devices to
    the assigned one (its default), the assigned id's position where all stay visible; 0 without GPUs."""
    if not assigned:
        return 0
    if len(assigned) != 1:
        raise PlacementError(f"this actor holds GPUs {list(assigned)}; a trainer rank takes exactly one")
    gpu = str(assigned[0])
    if visible is None:
        return int(gpu)
    listed = [d.strip() for d in visible.split(",") if d.strip()]
    if gpu not in listed:
        raise PlacementError(f"Ray assigned GPU {gpu}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    return listed.index(gpu)
