"""The training loop shared by CPT, long-context CPT and SFT.

One optimizer step:
  1. read this DP rank's micro-batches for the global batch (deterministic
     in the number of consumed samples, so a resumed run reads the same data);
     under context parallelism each CP rank keeps its zigzag share;
  2. count the loss tokens of the whole global batch (one all-reduce over
     DP x CP), so the loss is a per-token mean that does not depend on how
     the batch is split;
  3. forward/backward each micro-batch: LM loss + MTP loss (self-distillation
     toward the main head, or CE);
  4. megatron-core `finalize_model_grads`: DP/EP gradient reduction and the
     aux-loss-free expert-bias update;
  5. gradient norm (dense + expert shards), NaN/Inf guard (skip the update),
     clipping, optimizer step with the scheduled LR.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

from ..data.datasets import epoch_index
from ..config.model import ModelConfig, count_parameters, training_flops_per_token
from ..models import ParallelSizes, build_model, composer_forward
from ..models.forward import unwrap
from ..parallel import ParallelLayout, ZigzagLayout, cp_shift_left, shift_left, zigzag_batch
from ..parallel.fsdp import apply_dual_mesh_hsdp, dense_mesh, expert_mesh, sharded_grad_norm
from .batches import Batch, collate, micro_batch_indices
from .losses import lm_loss, mtp_cross_entropy_loss, mtp_self_distillation_loss, mtp_valid_mask
from .schedule import learning_rate


@dataclass
class StepResult:
    lm_loss: float
    mtp_loss: float
    grad_norm: float
    tokens: int
    skipped: bool
    lr: float
    seconds: float


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    history: list = field(default_factory=list)


def initialize_parallel(parallel: ParallelSizes, seed: int,
                        num_experts: Optional[int] = None) -> ParallelLayout:
    """megatron-core parallel state for these sizes, through the validated
    dense/expert `ParallelLayout` (replaces any previous state); returns the layout."""
    layout = ParallelLayout.from_sizes(dist.get_world_size(), parallel, num_experts)
    layout.initialize()
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return layout


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases and 1-D tensors take no weight decay (Megatron's rule)."""
    return param.ndim < 2 or name.endswith(".bias")


def build_adamw(model, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                params: Optional[list] = None) -> torch.optim.AdamW:
    named = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
    if params is not None:
        wanted = {id(p) for p in params}
        named = [(n, p) for n, p in named if id(p) in wanted]
    decay = [p for n, p in named if not is_no_decay(n, p)]
    no_decay = [p for n, p in named if is_no_decay(n, p)]
    groups = [g for g in (
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ) if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def grad_norm(params) -> torch.Tensor:
    """Global L2 norm of the reduced gradients.

    Dense gradients are identical on every DP rank after the reduction and
    count once; expert gradients are sharded over EP ranks and are summed
    over the expert-model-parallel group; tensor-parallel shards over TP.
    """
    dense_rep = torch.zeros((), dtype=torch.float64)
    dense_tp = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = _grad(p)
        if g is None:
            continue
        sq = g.detach().double().pow(2).sum().cpu()
        if not getattr(p, "allreduce", True):
            expert += sq
        elif getattr(p, "tensor_model_parallel", False):
            dense_tp += sq
        else:
            dense_rep += sq
    if dist.is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(dense_tp, group=parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_expert_model_parallel_world_size() > 1 or \
                parallel_state.get_expert_tensor_parallel_world_size() > 1:
            dist.all_reduce(expert, group=parallel_state.get_expert_tensor_and_model_parallel_group())
    return (dense_rep + dense_tp + expert).sqrt()


def update_expert_bias(model) -> None:
    """Aux-loss-free balancing step for every router (what megatron-core's
    finalize_model_grads does for DDP): all-reduce the tokens each expert
    received this step, move each bias by +-rate toward balance, reset counts."""
    routers = [m for m in unwrap(model).modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    counts = torch.stack([m.local_tokens_per_expert for m in routers])
    biases = torch.stack([m.expert_bias for m in routers])
    updated = get_updated_expert_bias(counts, biases, routers[0].config.moe_router_bias_update_rate)
    for m, bias in zip(routers, updated):
        m.expert_bias.copy_(bias)
        m.local_tokens_per_expert.zero_()


def _grad(p):
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


class Trainer:
    """Owns the model, optimizer and data of one run; `step()` does one update."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        parallel: ParallelSizes,
        dataset,
        *,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: Optional[int] = None,
        lr: float = 1e-3,
        min_lr: float = 1e-4,
        warmup_iters: int = 0,
        decay_iters: int = 100,
        decay_style: str = "cosine",
        weight_decay: float = 0.1,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        seed: int = 1234,
        params_dtype: torch.dtype = torch.float32,
        mtp_loss: str = "self-distill",
        mtp_loss_scaling_factor: float = 0.1,
        mtp_freeze_trunk: bool = False,
        reset_attention_mask: bool = False,
        optimizer_factory: Optional[Callable] = None,
        batch_transform: Optional[Callable] = None,
        pad_to_multiple: bool = False,
        moe_expert_precision: str = "bf16",
        moe_dispatch_precision: str = "bf16",
        data_parallel_sharding: str = "ddp",
        dense_shard_size: Optional[int] = None,
    ):
        self.layout = initialize_parallel(parallel, seed, model_cfg.num_experts or None)
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.pad_to_multiple = pad_to_multiple
        self.model_cfg = model_cfg
        self.parallel = parallel
        self.dataset = dataset
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.global_batch_size = global_batch_size or micro_batch_size * self.dp_size
        micro_batch_indices(0, self.global_batch_size, micro_batch_size, 0, self.dp_size)  # validate
        self.schedule = dict(lr=lr, min_lr=min_lr, warmup_iters=warmup_iters,
                             decay_iters=decay_iters, style=decay_style)
        self.clip_grad = clip_grad
        self.seed = seed
        self.mtp_loss = mtp_loss
        self.mtp_scale = mtp_loss_scaling_factor
        self.reset_attention_mask = reset_attention_mask
        self.batch_transform = batch_transform

        gpt = build_model(model_cfg, parallel, params_dtype=params_dtype, seq_length=seq_length,
                          moe_expert_precision=moe_expert_precision,
                          moe_dispatch_precision=moe_dispatch_precision,
                          calculate_per_token_loss=True)
        if mtp_freeze_trunk:
            if not model_cfg.mtp_num_layers:
                raise ValueError("--mtp-freeze-trunk needs --mtp-num-layers >= 1")
            for name, p in gpt.named_parameters():
                p.requires_grad_(name.startswith("mtp."))
        self.sharding = data_parallel_sharding
        if data_parallel_sharding == "hsdp":
            self.model = self._shard_hsdp(gpt, parallel, dense_shard_size)
        elif data_parallel_sharding == "ddp":
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            )
            self.model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
        else:
            raise ValueError(f"--data-parallel-sharding {data_parallel_sharding!r}; use ddp or hsdp")
        self.params = [p for p in gpt.parameters() if p.requires_grad]
        if optimizer_factory is None:
            self.optimizer = build_adamw(self.model, lr, weight_decay, betas, eps)
        else:
            self.optimizer = optimizer_factory(self.model)
        self.state = TrainState()
        self.flops_per_token = training_flops_per_token(model_cfg, seq_length)
        self.param_count = count_parameters(model_cfg)

    def _shard_hsdp(self, gpt, parallel: ParallelSizes, dense_shard_size: Optional[int]):
        """Dual-mesh HSDP (FSDP2): dense weights over a narrow CP-including mesh,
        experts over the wide expert-data-parallel mesh."""
        if parallel.tensor_model_parallel_size != 1 or parallel.expert_tensor_parallel_size != 1:
            raise ValueError("--data-parallel-sharding hsdp needs TP = ETP = 1 "
                             "(the recipe scales with CP x EP x FSDP instead)")
        world = dist.get_world_size()
        cp = parallel.context_parallel_size
        dense = dense_mesh(world, dense_shard_size or max(cp, min(world, 2)), cp)
        experts = expert_mesh(world, parallel.expert_model_parallel_size,
                              self.layout.groups()["edp"])
        return apply_dual_mesh_hsdp(gpt, dense, experts)

    # ---- data ---------------------------------------------------------------
    def micro_batches(self, consumed_samples: int) -> list[Batch]:
        n = len(self.dataset)
        batches = []
        for indices in micro_batch_indices(consumed_samples, self.global_batch_size,
                                           self.micro_batch_size, self.dp_rank, self.dp_size):
            samples = [self.dataset[epoch_index(i, n, self.seed)] for i in indices]
            batch = collate(samples, self.reset_attention_mask)
            batch = self.batch_transform(batch) if self.batch_transform else batch
            # CP: every rank of a CP group read the same samples; keep its zigzag share.
            batches.append(zigzag_batch(batch, self.cp_size, self.cp_rank, self.pad_to_multiple))
        return batches

    def mtp_shift(self, batch: Batch):
        """The MTP losses' shift along the sequence: across CP ranks under CP."""
        if self.cp_size == 1:
            return shift_left
        layout = ZigzagLayout.for_local_tokens(batch.tokens.shape[1], self.cp_size,
                                               batch.packed_seq_params)
        group = parallel_state.get_context_parallel_group()
        return lambda x, depth, fill: cp_shift_left(x, depth, fill, layout, self.cp_rank, group)

    # ---- losses -------------------------------------------------------------
    def losses(self, batch: Batch):
        """(lm loss sum, lm tokens, mtp loss sum, mtp positions) of one micro-batch."""
        logits, mtp_logits = composer_forward(
            self.model, batch.tokens, batch.position_ids, batch.packed_seq_params
        )
        lm_sum, lm_tokens = lm_loss(logits, batch.labels, batch.loss_mask)
        mtp_sum = torch.zeros(())
        mtp_count = torch.zeros(())
        shift = self.mtp_shift(batch)
        for depth, head in enumerate(mtp_logits, start=1):
            if self.mtp_loss == "self-distill":
                s, c = mtp_self_distillation_loss(head, logits, batch.loss_mask, depth,
                                                  batch.segment_ids, shift)
            else:
                s, c = mtp_cross_entropy_loss(head, batch.labels, batch.loss_mask, depth,
                                              batch.segment_ids, shift)
            mtp_sum = mtp_sum + s
            mtp_count = mtp_count + c
        return lm_sum, lm_tokens, mtp_sum, mtp_count

    def _global_counts(self, batches: list[Batch]) -> torch.Tensor:
        depth = self.model_cfg.mtp_num_layers
        counts = torch.zeros(2, dtype=torch.float64)
        for b in batches:
            counts[0] += b.loss_mask.sum()
            shift = self.mtp_shift(b) if depth else None
            for k in range(1, depth + 1):
                counts[1] += mtp_valid_mask(b.loss_mask, k, b.segment_ids, shift).sum()
        if dist.is_initialized():
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return counts

    # ---- one update ---------------------------------------------------------
    def step(self) -> StepResult:
        start = time.perf_counter()
        st = self.state
        self.model.train()
        batches = self.micro_batches(st.consumed_samples)
        counts = self._global_counts(batches)
        lm_total, mtp_total = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        if self.sharding == "ddp":
            self.model.zero_grad_buffer()
        for p in self.params:
            p.grad = None
        n_lm = max(counts[0].item(), 1.0)
        n_mtp = max(counts[1].item(), 1.0)
        for batch in batches:
            lm_sum, _, mtp_sum, _ = self.losses(batch)
            loss = lm_sum / n_lm
            if mtp_sum.requires_grad:
                loss = loss + self.mtp_scale * mtp_sum / n_mtp
            loss.backward()
            lm_total += lm_sum.detach().double()
            mtp_total += mtp_sum.detach().double()
        if self.sharding == "ddp":
            finalize_model_grads([self.model])  # DP/EP reduction + expert-bias update
        else:
            update_expert_bias(self.model)  # FSDP2 reduced the gradients in backward
        totals = torch.stack([lm_total, mtp_total])
        if dist.is_initialized():
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if self.sharding == "ddp":
            norm = grad_norm(self.params).item()
        else:
            norm = sharded_grad_norm(self.params, parallel_state.get_expert_model_parallel_group()).item()
        lr = learning_rate(st.iteration, **self.schedule)
        skipped = not math.isfinite(norm)
        if not skipped:
            for p in self.params:
                p.grad = _grad(p)
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
            if self.clip_grad and norm > self.clip_grad:
                scale = self.clip_grad / (norm + 1e-6)
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
            self.optimizer.step()
        else:
            st.skipped_iterations += 1
        for p in self.params:
            p.grad = None
        tokens = self.global_batch_size * self.seq_length
        st.iteration += 1
        st.consumed_samples += self.global_batch_size
        result = StepResult(
            lm_loss=(totals[0] / n_lm).item(),
            mtp_loss=(totals[1] / n_mtp).item() if counts[1] > 0 else 0.0,
            grad_norm=norm,
            tokens=tokens,
            skipped=skipped,
            lr=lr,
            seconds=time.perf_counter() - start,
        )
        st.history.append(result.lm_loss)
        return result

    @torch.no_grad()
    def evaluate(self, dataset, iters: int) -> float:
        """Per-token LM loss on `iters` global batches of `dataset` (from its start)."""
        self.model.eval()
        saved, self.dataset = self.dataset, dataset
        total = torch.zeros(2, dtype=torch.float64)
        try:
            for i in range(iters):
                for batch in self.micro_batches(i * self.global_batch_size):
                    s, c, _, _ = self.losses(batch)
                    total += torch.stack([s.double(), c.double()])
        finally:
            self.dataset = saved
            self.model.train()
        if dist.is_initialized():
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return (total[0] / total[1].clamp(min=1)).item()
