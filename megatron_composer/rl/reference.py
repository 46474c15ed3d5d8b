"""The frozen reference model of the KL (`--kl-coef` > 0) and where its weights live between uses.

The reference is used once per step, for the no-grad forwards of `RLTrainer.prepare` (the reference
log-prob of every token), and holds the weights RL started from. Its placement:

* the policy's layout: under EP this rank's experts only; under CP the forward runs on the rank's zigzag
  share; under HSDP (`--data-parallel-sharding hsdp`) the weights are sharded like the policy's, by the
  same `parallel.fsdp.apply_dual_mesh_hsdp` over the policy's own meshes (dense weights over the dense
  shard group, experts over the expert-data-parallel ranks), with no gradients and no optimizer state.
  Each unit is resharded after its forward (the policy's dense units keep theirs for the backward), so
  a forward holds one gathered layer at a time. Memory per rank: 4 bytes (fp32) per parameter of the
  rank's EP share, divided by the shard sizes under HSDP (`planner.rl.reference_bytes`);
* `--reference-offload`, on any layout: the parameters (the HSDP shards, where sharded) stay in host
  memory, pinned under CUDA, and are copied to the device for the step's reference forwards
  (`ReferenceModel.resident`). The host copy is kept, so the way back copies nothing (the weights are
  frozen): the cost is one host-to-device copy of the rank's reference bytes per step, and the device
  holds them only while `prepare` runs, before the policy's activations exist.

The reference computes in fp32 whatever the policy's --bf16: its log-probs are those of the loaded
weights. The device copy goes through `nn.Module._apply`, which FSDP2 supports for its sharded
parameters (it re-registers them after the move).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.distributed.fsdp import FSDPModule

from ..checkpoint.state import load_model_state_dict, model_state_dict
from ..models import build_model
from ..parallel.fsdp import apply_dual_mesh_hsdp
from ..parallel.wrappers import unwrap


def _policy_meshes(policy) -> tuple:
    """(dense mesh, expert mesh or None) of an HSDP-sharded policy, read from its parameters."""
    dense = experts = None
    for p in unwrap(policy).parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        if getattr(p, "allreduce", True):
            dense = dense or mesh
        else:
            experts = experts or mesh
    if dense is None:
        raise RuntimeError("internal: --data-parallel-sharding hsdp but the policy has no sharded parameter")
    return dense, experts


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host in page-locked memory (a DTensor: its local shard)."""
    local = getattr(t, "_local_tensor", None)
    if local is None:
        return t.cpu().pin_memory()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.cpu().pin_memory(), t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


class ReferenceModel:
    """The frozen reference GPTModel (`module`), resident on `device` or offloaded to the host
    (`offload`; module docstring). Its forwards run inside `resident()`."""

    def __init__(self, module: torch.nn.Module, device: torch.device, offload: bool):
        self.module, self.device, self.offload = module, torch.device(device), offload
        for p in module.parameters():
            p.requires_grad_(False)
        module.eval()
        if offload:
            pin = self.device.type == "cuda"
            module._apply(_pinned if pin else (lambda t: t.cpu()))

    def local_bytes(self) -> int:
        """Bytes of this rank's reference parameters (the local shards under HSDP), wherever they are."""
        return sum(_local(p).numel() * _local(p).element_size() for p in self.module.parameters())

    @contextmanager
    def resident(self) -> Iterator[torch.nn.Module]:
        """The module with its weights on the device for the duration; offloaded, a copy is made there and
        dropped on the way out (the host tensors were kept: nothing is copied back)."""
        if not self.offload:
            try:
                yield self.module
            finally:
                self._reshard()
            return
        host: list[torch.Tensor] = []

        def to_device(t: torch.Tensor) -> torch.Tensor:
            host.append(t.detach())  # a second handle on the host storage (the module's may be swapped)
            return t.to(self.device, non_blocking=True)

        self.module._apply(to_device)
        try:
            yield self.module
        finally:
            kept = iter(host)  # `_apply` visits the tensors in the same order both ways (and reshards)
            self.module._apply(lambda t: next(kept))

    def _reshard(self) -> None:
        """Free any gathered weights left after the forwards (a forward that raised midway)."""
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def build_reference_model(trainer, load: Optional[str], offload: bool) -> ReferenceModel:
    """The reference for `trainer` (a `training.Trainer`) at its layout: the weights of checkpoint `load`
    (the run's first --load), else the policy's current ones; sharded like the policy under HSDP."""
    ref = build_model(trainer.model_cfg, trainer.layout, seq_length=trainer.cfg.seq_length).to(trainer.device)
    if load:
        from ..checkpoint import load_checkpoint
        from ..checkpoint.tracker import latest_iteration

        load_checkpoint(load, ref, iteration=latest_iteration(load), allow_missing=("mtp.",),
                        verify=trainer.cfg.checkpoint.verify_checkpoint)
    else:  # whole tensors (HSDP shards the policy's), under global names (EP: this rank's experts)
        full = lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v  # noqa: E731
        load_model_state_dict(ref, {name: full(v) for name, v in model_state_dict(trainer.model).items()})
    if trainer.cfg.data_parallel_sharding == "hsdp":  # loaded whole, then sharded, as the policy is
        dense, experts = _policy_meshes(trainer.model)
        apply_dual_mesh_hsdp(ref, dense, experts, reshard_after_forward=True)
    return ReferenceModel(ref, trainer.device, offload)
