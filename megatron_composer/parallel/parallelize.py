"""Apply data parallelism to a built model in one place.

`parallelize(gpt, layout, sharding=...)` wraps the GPTModel for the chosen
data-parallel sharding and returns a `ParallelModel` whose methods are the
same for both kinds, so the training step never branches on the sharding:

* `ddp`: megatron-core `DistributedDataParallel` (replicated weights, fp32
  gradient buffers `main_grad`, all-reduced over DP x CP; experts over EDP).
  With `overlap_grad_reduce` (megatron's `overlap_grad_reduce`, on by
  default) the buffers are split into buckets of about `bucket_size`
  parameters and, in the last micro-batch's backward, each bucket's
  all-reduce starts asynchronously as soon as all its gradients have been
  accumulated; `finalize_grads` waits for them. The sums are the same
  element-wise additions as one all-reduce after the backward. Every
  trainable parameter must get a gradient in every update (megatron counts
  them per bucket); the first update names those that do not;
* `hsdp`: torch FSDP2 with dual meshes (`parallel.fsdp`): dense weights over a
  narrow (replicate, shard) mesh that includes the CP ranks, experts over the
  expert-data-parallel mesh. With bf16 compute the sharded parameters stay
  fp32 and FSDP2 casts them for the forward (`MixedPrecisionPolicy(param_dtype
  =bf16, reduce_dtype=fp32)`).

Everything here stays on the device: the norm is a device scalar and the
expert-bias update never reads counts back to the host (the optimizer's skip
decision is the one place the norm is synced).

Either way, after `finalize_grads()` every trainable parameter's reduced
fp32 gradient is `grads()[i]` and `grad_norm()` is the global L2 norm, with
one implementation: squares of the local gradients are summed per reduction
bucket (`torch._foreach_norm` accumulating in fp64: an fp32 norm of a large
tensor is off by ~1e-5) and all-reduced over the ranks that
hold disjoint pieces of them (TP shards, EP experts, FSDP shards); replicas
count once.

The aux-loss-free expert-bias update is not part of `finalize_grads`: it
runs in `update_expert_bias(applied)` after the step's skip decision, so a
skipped step moves no bias.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

from ..platform.distributed import local_device
from .fsdp import apply_dual_mesh_hsdp, dense_mesh, expert_mesh
from .layout import ParallelLayout
from .wrappers import unwrap

SHARDINGS = ("ddp", "hsdp")


def _routers(gpt) -> list:
    return [m for m in gpt.modules() if getattr(m, "expert_bias", None) is not None]


@contextmanager
def _expert_bias_update_deferred(gpt):
    """megatron-core's `finalize_model_grads` updates the expert bias (and
    resets the token counts) whenever the config enables it; we decide after
    the NaN guard, so hide the switch while it runs."""
    config = gpt.config
    enabled = config.moe_router_enable_expert_bias
    config.moe_router_enable_expert_bias = False
    try:
        yield
    finally:
        config.moe_router_enable_expert_bias = enabled


class ParallelModel:
    """A data-parallel model with sharding-independent gradient handling."""

    def __init__(self, module, gpt, sharding: str, params: list[torch.nn.Parameter],
                 norm_buckets: list[tuple[list[int], list]]):
        self.module = module  # what the forward runs (DDP wrapper or the sharded GPTModel)
        self.gpt = gpt
        self.sharding = sharding
        self.params = params
        self._norm_buckets = norm_buckets  # (indices into params, process groups to sum over)
        self._routers = _routers(gpt)

    # ---- gradients ----------------------------------------------------------
    def zero_grad(self) -> None:
        if self.sharding == "ddp":
            self.module.zero_grad_buffer()
        for p in self.params:
            p.grad = None

    def no_sync(self, accumulate_only: bool = True):
        """Context for a micro-batch's backward: with `accumulate_only`, gradients accumulate
        locally and no reduce starts (every micro-batch but an update's last). FSDP2 reduces
        every micro-batch's gradients in its backward either way."""
        if self.sharding == "ddp" and accumulate_only:
            return self.module.no_sync()
        return nullcontext()

    def finalize_grads(self) -> None:
        """Reduce gradients over data-parallel replicas, or wait for the reduces the backward
        started (FSDP2 did it in backward)."""
        if self.sharding == "ddp":
            _check_every_param_got_a_gradient(self.module)
            with _expert_bias_update_deferred(self.gpt):
                finalize_model_grads([self.module])

    def grads(self) -> list[Optional[torch.Tensor]]:
        """The reduced fp32 gradient of every trainable parameter (None if unused)."""
        if self.sharding == "ddp":
            return [p.main_grad for p in self.params]
        return [p.grad for p in self.params]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (fp64 scalar, same on every rank)."""
        grads = self.grads()
        device = next((g.device for g in grads if g is not None), None) or local_device()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for indices, groups in self._norm_buckets:
            local = [_local(grads[i]) for i in indices if grads[i] is not None]
            if not local:
                squares = torch.zeros((), dtype=torch.float64, device=device)
            else:
                squares = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float64)).square().sum()
            for group in groups:
                dist.all_reduce(squares, group=group)
            total += squares
        return total.sqrt()

    # ---- expert bias --------------------------------------------------------
    def update_expert_bias(self, applied: bool) -> None:
        """Aux-loss-free balancing for an applied step: all-reduce the tokens each
        expert received, move each bias by +-rate toward balance; reset the counts
        either way."""
        if not self._routers:
            return
        if applied:
            counts = torch.stack([m.local_tokens_per_expert for m in self._routers])
            biases = torch.stack([m.expert_bias for m in self._routers])
            updated = get_updated_expert_bias(counts, biases, self.gpt.config.moe_router_bias_update_rate)
            for m, bias in zip(self._routers, updated):
                m.expert_bias.copy_(bias)
        for m in self._routers:
            m.local_tokens_per_expert.zero_()

    # ---- forward ------------------------------------------------------------
    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)


def _check_every_param_got_a_gradient(ddp) -> None:
    """In its first update, megatron's overlapped reduce records how many gradients each bucket
    receives and later starts a bucket's all-reduce when that count is reached: a parameter that
    got none would stall that bucket from the second update on. Name them instead."""
    first = [g for g in ddp.bucket_groups + ddp.expert_parallel_bucket_groups if g.is_first_batch]
    if not ddp.ddp_config.overlap_grad_reduce or not first:
        return
    names = {p: n for n, p in ddp.module.named_parameters()}
    missing = [names[p] for g in first for p in g.params if p not in g.per_param_grad_ready_counts]
    if missing:
        raise RuntimeError(
            f"{len(missing)} trainable parameters got no gradient in this update (first: {missing[:3]}); "
            "the overlapped gradient reduce needs every trainable parameter in the loss. Freeze them "
            "(requires_grad=False) or turn the overlap off with --no-overlap-grad-reduce")


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _ddp_norm_groups(p) -> tuple:
    if not getattr(p, "allreduce", True):  # a routed expert: different experts on EP (x ETP) ranks
        if parallel_state.get_expert_tensor_and_model_parallel_world_size() > 1:
            return (parallel_state.get_expert_tensor_and_model_parallel_group(),)
        return ()
    if getattr(p, "tensor_model_parallel", False) and parallel_state.get_tensor_model_parallel_world_size() > 1:
        return (parallel_state.get_tensor_model_parallel_group(),)
    return ()


def _hsdp_norm_groups(p) -> tuple:
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or ()
    shard_dim = names.index("shard") if "shard" in names else mesh.ndim - 1
    groups = [mesh.get_group(shard_dim)]
    if not getattr(p, "allreduce", True) and parallel_state.get_expert_model_parallel_world_size() > 1:
        groups.append(parallel_state.get_expert_model_parallel_group())
    return tuple(g for g in groups if dist.get_world_size(g) > 1)


def _buckets(params, groups_of) -> list[tuple[list[int], list]]:
    buckets: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault(groups_of(p), []).append(i)
    return [(indices, list(groups)) for groups, indices in buckets.items()]


def parallelize(gpt, layout: ParallelLayout, *, sharding: str = "ddp", dense_shard_size: Optional[int] = None,
                bf16: bool = False, overlap_grad_reduce: bool = True,
                bucket_size: Optional[int] = None) -> ParallelModel:
    """Wrap a built GPTModel for data parallelism (megatron-core's parallel state
    for `layout` must be initialized).

    `bf16`: under ddp the model must already hold bf16 parameters (megatron's
    fp32 gradient buffers accumulate and reduce in fp32); under hsdp it holds
    fp32 parameters that FSDP2 casts to bf16 for compute.

    `overlap_grad_reduce`, `bucket_size` (ddp only): megatron's; `bucket_size` None is
    megatron's default, max(4e7, 1e6 x DP) parameters per bucket.
    """
    if sharding == "ddp":
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce, bucket_size=bucket_size,
            use_distributed_optimizer=False)
        module = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
        groups_of = _ddp_norm_groups
    elif sharding == "hsdp":
        if layout.tp != 1 or layout.etp != 1:
            raise ValueError(f"--data-parallel-sharding hsdp needs TP = ETP = 1, got TP={layout.tp} "
                             f"ETP={layout.etp} (the recipe scales with CP x EP x FSDP instead)")
        dense = dense_mesh(layout.world_size, dense_shard_size or max(layout.cp, min(layout.world_size, 2)),
                           layout.cp)
        experts = expert_mesh(layout.world_size, layout.ep, layout.groups()["edp"])
        mp_policy = None
        if bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        module = apply_dual_mesh_hsdp(gpt, dense, experts, mp_policy=mp_policy)
        groups_of = _hsdp_norm_groups
    else:
        raise ValueError(f"--data-parallel-sharding {sharding!r}; use one of {', '.join(SHARDINGS)}")
    gpt = unwrap(module)
    params = [p for p in gpt.parameters() if p.requires_grad]
    return ParallelModel(module, gpt, sharding, params, _buckets(params, groups_of))
