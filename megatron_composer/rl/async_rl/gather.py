"""The whole policy on one trainer rank, for publishing to inference workers that hold the whole model.

The trainer ranks hold the policy sharded two ways, and the inference workers
need it whole, under the names a one-rank model has (`checkpoint.state`'s
global names):

* expert parallelism (`--expert-model-parallel-size`): EP rank r holds routed
  experts r * E/EP .. (r + 1) * E/EP - 1 under the local names 0 .. E/EP - 1;
  the ranks of the publishing rank's EP group send theirs to it
  (`torch.distributed.gather`, one call per expert tensor), and it names them
  `experts.{r * E/EP + i}` (`expert_global_name`);
* HSDP (`--data-parallel-sharding hsdp`): every parameter is an FSDP2 DTensor
  shard, dense ones over the dense mesh and experts over the expert-data-
  parallel mesh; `DTensor.full_tensor()` all-gathers each, on every rank of
  its mesh.

Both are collectives: every trainer rank calls `gather_policy` once per
published version, in the same order (the state dict's), and only the
publishing rank keeps the result. Each complete tensor goes to host memory
through `to_host` at once (the publisher's copy in its wire dtype), so device
memory holds one gathered tensor at a time.

Dense weights under DDP are replicated and expert weights are replicated over
the expert-data-parallel ranks, so ranks outside the publishing rank's EP
group send nothing. Tensor and pipeline parallelism would split tensors along
dimensions this does not join; they are refused with the fix named.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ...checkpoint.state import expert_global_name, expert_param_parts, global_param_names
from ...parallel.wrappers import unwrap


def check_publishable(tp: int, pp: int, etp: int) -> None:
    """Raise ValueError for a layout whose tensors `gather_policy` cannot join."""
    for flag, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                       ("--expert-tensor-parallel-size", etp)):
        if size != 1:
            raise ValueError(f"async RL publishes the whole policy gathered over expert parallelism and HSDP "
                             f"shards; {flag} {size} splits tensors it does not join; use {flag} 1 with "
                             f"--expert-model-parallel-size and --data-parallel-sharding hsdp to shard the trainer")


def _expert_group() -> tuple[int, Optional[dist.ProcessGroup], list[int]]:
    """(EP size, EP group, its global ranks in EP-rank order); size 1 without expert parallelism."""
    if not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_expert_model_parallel_world_size() <= 1:
        return 1, None, []
    group = parallel_state.get_expert_model_parallel_group()
    return dist.get_world_size(group), group, dist.get_process_group_ranks(group)


def gather_policy(model, to_host: Optional[Callable[[torch.Tensor], torch.Tensor]], *,
                  dst: int = 0) -> Optional[dict[str, torch.Tensor]]:
    """{global name: to_host(whole tensor)} of the model's parameters and persistent buffers on global rank
    `dst`, None on the other ranks (module docstring: a collective every rank joins).

    Args:
        model: the (wrapped) megatron-core GPTModel of this trainer rank.
        to_host: takes one whole tensor (on this rank's device, any dtype) and returns what is kept
            (e.g. `WeightPublisher.copy_tensor`: on the host, in the wire dtype); None on the ranks
            other than `dst`, which keep nothing.
        dst: the global rank that keeps the result.
    """
    gpt = unwrap(model)
    names = global_param_names(model)
    ep, group, ep_ranks = _expert_group()
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep, sends = rank == dst, dst in ep_ranks
    per_rank = (getattr(getattr(gpt, "config", None), "num_moe_experts", None) or 0) // ep
    out: dict[str, torch.Tensor] = {}
    for key, value in gpt.state_dict().items():
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        if hasattr(value, "full_tensor"):  # an FSDP2 shard: every rank of its mesh gathers it
            value = value.full_tensor()
        value = value.detach()
        if ep > 1 and expert_param_parts(key) is not None:
            if not sends:  # an expert-data-parallel replica of experts the publishing group holds
                continue
            value = value.contiguous()
            parts = [torch.empty_like(value) for _ in range(ep)] if keep else None
            dist.gather(value, parts, dst=dst, group=group)
            if keep:
                for r, part in enumerate(parts):
                    out[expert_global_name(key, r * per_rank)] = to_host(part)
        elif keep:
            out[names.get(key, key)] = to_host(value)
    return out if keep else None
