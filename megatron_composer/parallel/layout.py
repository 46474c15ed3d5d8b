"""The two device meshes of one run, over the same ranks ("parallel folding").

* dense mesh TP x CP x DP x PP: attention, dense MLPs, embeddings;
* expert mesh ETP x EP x EDP x PP: routed experts. EP is carved out of the
  DP x CP ranks of a pipeline stage, so EP=8 fits CP=2 x DP=4 (CPT) as well
  as CP=8 x DP=1 (RL) on 8 GPUs (the Composer 2 report's layouts).

`ParallelLayout` validates the sizes up front with errors that say what
would fit, computes every group with megatron-core's own `RankGenerator`
(so the description is exactly what `initialize_model_parallel` builds),
describes the groups rank by rank, and initializes megatron-core's parallel
state, handing back its `ProcessGroupCollection`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.parallel_state import RankGenerator
from megatron.core.process_groups_config import ProcessGroupCollection

# megatron-core's default order; TP innermost so TP ranks share a node.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"

# group name -> (mesh, megatron RankGenerator token)
_GROUPS = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "dp_cp": ("dense", "dp-cp"),
    "pp": ("dense", "pp"),
    "etp": ("expert", "tp"),
    "ep": ("expert", "ep"),
    "edp": ("expert", "dp"),
    "etp_ep": ("expert", "tp-ep"),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of both meshes; DP and EDP follow from the world size."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    num_experts: Optional[int] = None
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        self.validate()

    # ---- construction -------------------------------------------------------
    @classmethod
    def from_sizes(cls, world_size: int, sizes, num_experts: Optional[int] = None) -> "ParallelLayout":
        """From parsed `pretrain_cpt.py` args, or anything with Megatron's size names
        (`tensor_model_parallel_size`, `context_parallel_size`, ...)."""
        return cls(
            world_size=world_size,
            tp=sizes.tensor_model_parallel_size,
            cp=sizes.context_parallel_size,
            pp=sizes.pipeline_model_parallel_size,
            ep=sizes.expert_model_parallel_size,
            etp=sizes.expert_tensor_parallel_size,
            num_experts=num_experts,
        )

    # ---- sizes --------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def validate(self) -> None:
        """Raise ValueError naming the sizes that do not fit and what would."""
        for name in ("world_size", "tp", "cp", "pp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.upper()} must be >= 1, got {getattr(self, name)}")
        dense = self.tp * self.cp * self.pp
        if self.world_size % dense:
            outer = self.tp * self.pp
            fits = _divisors(self.world_size // outer) if self.world_size % outer == 0 else []
            hint = f"; with this TP and PP, CP can be one of {fits}" if fits else ""
            raise ValueError(
                f"world size {self.world_size} is not divisible by TP x CP x PP = {dense} "
                f"(TP={self.tp}, CP={self.cp}, PP={self.pp}); launch a multiple of {dense} "
                f"ranks{hint}"
            )
        stage = self.world_size // self.pp  # ranks of one pipeline stage = TP x CP x DP
        if stage % (self.etp * self.ep):
            fits = [e for e in _divisors(stage // self.etp) if stage % self.etp == 0
                    and (not self.num_experts or self.num_experts % e == 0)]
            what = (f"EP={self.ep} does not divide DP x CP = {self.dp * self.cp} "
                    f"(DP={self.dp}, CP={self.cp})") if self.tp == 1 and self.etp == 1 else (
                f"ETP x EP = {self.etp} x {self.ep} does not divide TP x CP x DP = {stage} "
                f"(TP={self.tp}, CP={self.cp}, DP={self.dp})")
            raise ValueError(
                f"{what}: the expert mesh is carved out of the {stage} ranks of a pipeline "
                f"stage; use EP in {fits} or launch a multiple of {self.etp * self.ep * self.pp} ranks"
            )
        if self.num_experts and self.num_experts % self.ep:
            fits = [e for e in _divisors(self.num_experts) if stage % (self.etp * e) == 0]
            raise ValueError(
                f"EP={self.ep} does not divide the {self.num_experts} experts; use EP in {fits}"
            )

    # ---- groups -------------------------------------------------------------
    def _generators(self) -> dict[str, RankGenerator]:
        return {
            "dense": RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=self.cp,
                                   order=self.order),
            "expert": RankGenerator(tp=self.etp, ep=self.ep, dp=self.edp, pp=self.pp, cp=1,
                                    order=self.order),
        }

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind (tp, cp, dp, dp_cp, pp, etp, ep, edp, etp_ep), as global ranks."""
        gens = self._generators()
        return {name: gens[mesh].get_ranks(token) for name, (mesh, token) in _GROUPS.items()}

    def group_of(self, name: str, rank: int) -> list[int]:
        """The `name` group that contains `rank`."""
        for group in self.groups()[name]:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is outside world size {self.world_size}")

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index inside each of its groups (its tp/cp/dp/ep/edp... rank)."""
        return {name: self.group_of(name, rank).index(rank) for name in _GROUPS}

    def describe(self) -> str:
        """Both meshes and, rank by rank, which ranks form its CP / DP / EP / EDP groups."""
        lines = [
            f"dense mesh:  TP={self.tp} x CP={self.cp} x DP={self.dp} x PP={self.pp}",
            f"expert mesh: ETP={self.etp} x EP={self.ep} x EDP={self.edp} x PP={self.pp}"
            + (f" ({self.num_experts // self.ep} of {self.num_experts} experts per rank)"
               if self.num_experts else ""),
        ]
        groups = self.groups()
        for name in ("cp", "dp", "dp_cp", "ep", "edp"):
            lines.append(f"  {name:<6} groups: {groups[name]}")
        for rank in range(self.world_size):
            parts = []
            for name in ("tp", "cp", "dp", "ep", "edp"):
                group = self.group_of(name, rank)
                parts.append(f"{name} {group.index(rank)} of {group}")
            lines.append(f"  rank {rank}: " + " | ".join(parts))
        return "\n".join(lines)

    # ---- megatron-core ------------------------------------------------------
    def initialize(self, timeout_minutes: int = 30) -> ProcessGroupCollection:
        """Initialize megatron-core's parallel state for this layout (replacing any
        previous one) and return its process groups, whose collectives time out
        after `timeout_minutes`.

        Needs torch.distributed initialized with `world_size` ranks.
        """
        if not dist.is_initialized():
            raise RuntimeError("initialize torch.distributed first (platform.init_distributed)")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"layout is for {self.world_size} ranks, but torch.distributed "
                             f"has {dist.get_world_size()}")
        key = (self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp, self.order, timeout_minutes)
        if _INITIALIZED.get("key") == key and _groups_alive():
            # The same layout again (tests, notebooks, an engine beside its trainer): keep its
            # groups. megatron-core's destroy_model_parallel forgets groups without destroying
            # them, so every rebuild would leave its gloo threads running.
            return self._checked(ProcessGroupCollection.use_mpu_process_groups())
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            order=self.order,
            distributed_timeout_minutes=timeout_minutes,
        )
        _INITIALIZED["key"] = key
        return self._checked(ProcessGroupCollection.use_mpu_process_groups())

    def _checked(self, pgs: ProcessGroupCollection) -> ProcessGroupCollection:
        rank = dist.get_rank()
        for name, group in (("tp", pgs.tp), ("cp", pgs.cp), ("dp_cp", pgs.dp_cp), ("ep", pgs.ep),
                            ("edp", pgs.expt_dp)):
            live = dist.get_process_group_ranks(group)
            if live != self.group_of(name, rank):  # megatron-core changed its rank order
                raise RuntimeError(f"megatron-core built {name} group {live} for rank {rank}, "
                                   f"layout expected {self.group_of(name, rank)}")
        return pgs


_INITIALIZED: dict = {}  # the layout megatron-core's parallel state was last built for


def _groups_alive() -> bool:
    """Whether megatron-core's groups still belong to a live torch.distributed (a
    destroyed default group takes its subgroups with it)."""
    if not parallel_state.model_parallel_is_initialized():
        return False
    try:
        dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    except (RuntimeError, ValueError, KeyError):
        return False
    return True


def initialize_parallel(layout: ParallelLayout, seed: int, timeout_minutes: int = 30) -> ProcessGroupCollection:
    """megatron-core parallel state for `layout` (replacing any previous one) and
    seeded RNGs: torch's, and megatron's model-parallel RNG tracker."""
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    pgs = layout.initialize(timeout_minutes)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return pgs
