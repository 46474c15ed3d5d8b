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
import torch.distributed as dist
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


def apply_dual_mesh_hsdp(model, dense: DeviceMesh, experts: DeviceMesh):
    """Shard `model` (a GPTModel) in place: experts over `experts`, the rest over `dense`."""
    if model.share_embeddings_and_output_weights:
        raise ValueError("HSDP sharding needs untied embeddings and output weights "
                         "(untie_embeddings_and_output_weights=True)")
    for module in _routed_experts(model):
        fully_shard(module, mesh=experts)
        _sum_gradients(module)
        for p in module.parameters():
            p.allreduce = False  # megatron's expert mark; fully_shard made new Parameters
    for module in list(_layers(model)) + list(_top_level_modules(model)):
        fully_shard(module, mesh=dense)
        _sum_gradients(module)
    leftovers = [n for n, p in model.named_parameters()
                 if not type(p).__name__ == "DTensor" and not hasattr(p, "_local_tensor")]
    if leftovers:
        raise RuntimeError(f"parameters outside every sharded module: {leftovers[:5]}")
    return model


def sharded_grad_norm(params, expert_model_parallel_group=None) -> torch.Tensor:
    """Global L2 grad norm of FSDP2 (DTensor) parameters.

    Squares are summed locally per mesh, all-reduced over that mesh's ranks
    (shards are disjoint; replicas are counted once by taking only the shard
    dimension), then expert norms are summed over EP (different experts).
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict[int, list] = {}
    meshes = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        key = id(g.device_mesh) if isinstance(g, DTensor) else 0
        meshes.setdefault(key, g.device_mesh if isinstance(g, DTensor) else None)
        expert = not getattr(p, "allreduce", True)
        by_mesh.setdefault((key, expert), []).append(local.detach().double().pow(2).sum())
    total = torch.zeros((), dtype=torch.float64)
    expert_total = torch.zeros((), dtype=torch.float64)
    for (key, expert), squares in by_mesh.items():
        s = torch.stack(squares).sum()
        mesh = meshes[key]
        if mesh is not None:
            shard_dim = mesh.mesh_dim_names.index("shard") if mesh.mesh_dim_names and "shard" in mesh.mesh_dim_names else mesh.ndim - 1
            dist.all_reduce(s, group=mesh.get_group(shard_dim))
        if expert:
            expert_total += s
        else:
            total += s
    if expert_model_parallel_group is not None and dist.get_world_size(expert_model_parallel_group) > 1:
        dist.all_reduce(expert_total, group=expert_model_parallel_group)
    return (total + expert_total).sqrt()
