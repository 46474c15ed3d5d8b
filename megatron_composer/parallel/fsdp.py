"""Dual-mesh HSDP with torch FSDP2 (`fully_shard`), as in Composer 2.5.

Two sharding meshes over the same ranks:

* dense weights (attention, dense FFN, shared experts, router, norms,
  embeddings, MTP glue) on a narrow 2-D mesh (replicate, shard): shard groups
  are `dense_shard_size` consecutive ranks, which in megatron's rank order
  (tp-cp-ep-dp-pp, TP = 1) are whole CP groups, so CP ranks also shard
  parameters and optimizer state; the shards are replicated across the rest;
* routed experts, already split over EP, on the wide expert-data-parallel
  mesh: each expert's weights are sharded over all EDP ranks holding a copy.

Gradients are summed (divide factor 1): the training loop normalizes the loss
by the global token count itself. One code path on CPU/gloo and CUDA/NCCL.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def dense_mesh(world_size: int, shard_size: int, cp: int = 1) -> DeviceMesh:
    """(replicate, shard) mesh: shard groups of `shard_size` consecutive ranks."""
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"--dense-shard-size {shard_size} must divide the data x context parallel size "
            f"{world_size}; use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    if shard_size % cp:
        raise ValueError(
            f"--dense-shard-size {shard_size} must be a multiple of CP={cp} so that CP ranks "
            "shard the dense weights together"
        )
    mesh = torch.arange(world_size).reshape(world_size // shard_size, shard_size)
    return DeviceMesh(_device_type(), mesh, mesh_dim_names=("replicate", "shard"))


def expert_mesh(world_size: int, ep: int, edp_groups: Optional[list[list[int]]] = None) -> DeviceMesh:
    """1-D mesh over this rank's expert-data-parallel group (EP groups are consecutive ranks)."""
    mesh = torch.arange(world_size).reshape(world_size // ep, ep)
    if edp_groups is not None:
        expected = sorted(sorted(g) for g in edp_groups)
        got = sorted(sorted(col.tolist()) for col in mesh.t())
        if expected != got:
            raise ValueError(f"expert mesh columns {got} do not match megatron's EDP groups {expected}")
    full = DeviceMesh(_device_type(), mesh, mesh_dim_names=("edp", "ep"))
    return full["edp"]


def _routed_experts(model):
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            yield module


def _layers(model):
    for name, module in model.named_modules():
        if name.endswith(("decoder.layers", "mtp.layers")) and isinstance(module, torch.nn.ModuleList):
            yield from module


def _top_level_modules(model):
    """Modules outside the transformer layers that own parameters.

    They are sharded one by one rather than through a root `fully_shard`
    because `models.composer_forward` calls the GPTModel's submodules
    directly (to get MTP logits), so a root-level forward hook would never run.
    """
    for name in ("embedding", "output_layer", "decoder.final_layernorm"):
        module = model.get_submodule(name) if _has_submodule(model, name) else None
        if module is not None and any(True for _ in module.parameters()):
            yield module


def _has_submodule(model, name):
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def _sum_gradients(module) -> None:
    # Plain SUM collectives: a divide factor alone would use PREMUL_SUM, which gloo lacks.
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def apply_dual_mesh_hsdp(model, dense: DeviceMesh, experts: DeviceMesh, mp_policy=None,
                         reshard_after_forward: Optional[bool] = None):
    """Shard `model` (a GPTModel) in place: experts over `experts`, the rest over `dense`.

    `mp_policy`: an FSDP2 `MixedPrecisionPolicy` (bf16 compute over fp32 shards), or None.
    `reshard_after_forward`: None is FSDP2's default (every unit called directly is a root, which keeps its
    weights gathered after its forward, for the backward); True frees each unit's after its forward (a
    model that only runs forwards, as the RL reference).
    """
    extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if reshard_after_forward is not None:
        extra["reshard_after_forward"] = reshard_after_forward
    if model.share_embeddings_and_output_weights:
        raise ValueError("HSDP sharding needs untied embeddings and output weights "
                         "(untie_embeddings_and_output_weights=True)")
    for module in _routed_experts(model):
        fully_shard(module, mesh=experts, **extra)
        _sum_gradients(module)
        for p in module.parameters():
            p.allreduce = False  # megatron's expert mark; fully_shard made new Parameters
    for module in list(_layers(model)) + list(_top_level_modules(model)):
        fully_shard(module, mesh=dense, **extra)
        _sum_gradients(module)
    leftovers = [n for n, p in model.named_parameters()
                 if not type(p).__name__ == "DTensor" and not hasattr(p, "_local_tensor")]
    if leftovers:
        raise RuntimeError(f"parameters outside every sharded module: {leftovers[:5]}")
    return model
