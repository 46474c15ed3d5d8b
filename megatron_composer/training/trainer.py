"""The training loop shared by CPT, long-context CPT and SFT (and RL).

    trainer = Trainer(model_cfg, layout, TrainingData(train, valid), TrainingConfig(...))
    trainer.resume()          # --load: everything, or weights only (--finetune, next stage)
    trainer.train()           # log / eval / save intervals until --train-iters

Construction, in order (torchtitan's shape): megatron-core parallel state
for the layout, the model from our layer specs, moved whole onto this rank's
device (`platform.local_device`: megatron-core initializes its linears on the
current GPU, but the local spec's torch norms and our own modules are built
on the CPU), `parallel.parallelize` (DDP or dual-mesh HSDP),
`optim.build_optimizer` (AdamW or Muon + AdamW, fp32 main weights under
--bf16), the loss plug-ins.

One training step: `step()` reads the stage's data and hands it to
`train_step(micro_batches)`, which any other loop (RL) calls with batches of
its own; `update` is one optimizer update and `forward_backward` one
micro-batch of it:
  1. (`step`) read this DP rank's micro-batches for the global batch (deterministic
     in the number of consumed samples, so a resumed run reads the same data);
     under context parallelism each CP rank keeps its zigzag share; all of it
     on the host, then one non-blocking copy per micro-batch to the device;
  2. count every loss plug-in's positions over the whole global batch (one
     all-reduce over DP x CP), so each loss is a per-position mean that does
     not depend on how the batch is split;
  3. forward/backward each micro-batch through the plug-ins;
  4. reduce gradients over data-parallel replicas (under DDP, each bucket's
     all-reduce starts in the last micro-batch's backward as soon as its
     gradients are complete, `--overlap-grad-reduce`);
  5. the optimizer: global grad norm, non-finite skip, clipping, scheduled
     LR, update, finiteness of the new weights;
  6. the aux-loss-free expert-bias update, for applied steps only.

Every reduction runs on device tensors (NCCL reduces nothing else). The
update makes two host syncs of its own, whatever the model size: the
gradient norm (the skip decision and the clip factor), and one copy of the
logged [losses, counts] together with the new weights' non-finite flag.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..config.model import ModelConfig, training_flops_per_token
from ..config.training import TrainingConfig
from ..data import epoch_index
from ..models import build_model, composer_forward
from ..optim.builder import build_optimizer
from ..parallel import ParallelLayout, ZigzagLayout, cp_shift_left, shift_left, zigzag_batch
from ..parallel.layout import initialize_parallel
from ..parallel.parallelize import parallelize
from ..platform.distributed import local_device
from .batches import Batch, collate, micro_batch_indices
from .checkpointer import Checkpointer
from .logger import TrainingLogger
from .loss_plugins import ModelOutput, build_loss_plugins


class TrainingAborted(RuntimeError):
    """The run cannot continue (too many skipped steps); the last checkpoint is intact."""


@dataclass
class TrainingData:
    train: object  # a map-style dataset of packed samples (see `megatron_composer.data`)
    valid: Optional[object] = None


@dataclass
class StepResult:
    losses: dict  # plug-in name -> per-position mean over the global batch
    grad_norm: float
    tokens: int
    skipped: bool
    lr: float
    seconds: float

    @property
    def lm_loss(self) -> float:
        return self.losses["lm loss"]

    @property
    def mtp_loss(self) -> float:
        return self.losses.get("mtp loss", 0.0)


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    consecutive_skipped: int = 0


class Trainer:
    """Owns the model, optimizer, data and loop state of one run."""

    def __init__(self, model_cfg: ModelConfig, layout: ParallelLayout, data: TrainingData,
                 cfg: TrainingConfig, *, log: Optional[TrainingLogger] = None,
                 batch_transform: Optional[Callable[[Batch], Batch]] = None,
                 base_eval: Optional[Callable] = None):
        self.model_cfg, self.layout, self.data, self.cfg = model_cfg, layout, data, cfg
        self.base_eval = base_eval  # (model, model_cfg) -> scalars; `eval.hook.BaseEvalHook`
        self.log = log or TrainingLogger(dist.get_rank() if dist.is_initialized() else 0)
        self.batch_transform = batch_transform
        initialize_parallel(layout, cfg.seed, cfg.distributed_timeout_minutes)
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.global_batch_size = cfg.global_batch_size or cfg.micro_batch_size * self.dp_size
        micro_batch_indices(0, self.global_batch_size, cfg.micro_batch_size, 0, self.dp_size)  # validate

        if cfg.mtp_freeze_trunk and not model_cfg.mtp_num_layers:
            raise ValueError("--mtp-freeze-trunk needs --mtp-num-layers >= 1")
        gpt = self._build_model()
        self.device = local_device()
        gpt.to(self.device)  # before the DDP wrapper allocates its gradient buffers there
        self.model = parallelize(gpt, layout, sharding=cfg.data_parallel_sharding,
                                 dense_shard_size=cfg.dense_shard_size, bf16=cfg.bf16,
                                 overlap_grad_reduce=cfg.overlap_grad_reduce, bucket_size=cfg.ddp_bucket_size)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.loss_plugins = build_loss_plugins(model_cfg, cfg)
        self.state = TrainState()
        self.flops_per_token = training_flops_per_token(model_cfg, cfg.seq_length)
        # What a composing loop (RL) adds, set once after construction, never overridden methods:
        self.pre_forward: Optional[Callable[[Batch], None]] = None  # e.g. router replay's routes of the batch
        self.extra_meta: dict = {}  # plain values saved in the checkpoint meta, restored by a full resume
        self.extra_files: dict[str, bytes] = {}  # files saved inside each checkpoint (rank 0's)
        self.checkpoints = Checkpointer(self)

    def _build_model(self):
        """The GPTModel in the dtype its data-parallel wrapper expects, trunk frozen if asked."""
        cfg = self.cfg
        # --bf16: bf16 parameters under DDP; under HSDP fp32 shards that FSDP2 casts for compute.
        bf16_params = cfg.bf16 and cfg.data_parallel_sharding == "ddp"
        gpt = build_model(self.model_cfg, self.layout,
                          params_dtype=torch.bfloat16 if bf16_params else torch.float32,
                          seq_length=cfg.seq_length,
                          moe_expert_precision=cfg.moe_precision.moe_expert_precision,
                          moe_dispatch_precision=cfg.moe_precision.moe_dispatch_precision,
                          impl=cfg.transformer, recompute=cfg.recompute,
                          calculate_per_token_loss=True)
        if bf16_params:
            # megatron-core builds its torch norms in fp32 whatever params_dtype says;
            # Float16Module would cast them too. Buffers (expert-bias token counts) stay fp32.
            for p in gpt.parameters():
                p.data = p.data.to(torch.bfloat16)
        if cfg.mtp_freeze_trunk:
            for name, p in gpt.named_parameters():
                p.requires_grad_(name.startswith("mtp."))
        return gpt

    # ---- state --------------------------------------------------------------
    def state_dict(self) -> dict:
        """The loop's own state (model and optimizer are checkpointed beside it)."""
        st = self.state
        return dict(self.extra_meta, iteration=st.iteration, consumed_samples=st.consumed_samples,
                    skipped_iterations=st.skipped_iterations)

    def extra_checkpoint_files(self) -> dict[str, bytes]:
        """Files saved inside each checkpoint beside the model (rank 0's; RL adds its buffer)."""
        return dict(self.extra_files)

    def load_state_dict(self, state: dict) -> None:
        self.state.iteration = int(state["iteration"])
        self.state.consumed_samples = int(state["consumed_samples"])
        self.state.skipped_iterations = int(state.get("skipped_iterations", 0))
        self.state.consecutive_skipped = 0
        self.extra_meta.update({k: state[k] for k in self.extra_meta if k in state})

    # ---- data ---------------------------------------------------------------
    def micro_batches(self, consumed_samples: int, dataset=None) -> list[Batch]:
        """This rank's micro-batches of the global batch at `consumed_samples`, on the host."""
        dataset = dataset if dataset is not None else self.data.train
        n = len(dataset)
        batches = []
        for indices in micro_batch_indices(consumed_samples, self.global_batch_size,
                                           self.cfg.micro_batch_size, self.dp_rank, self.dp_size):
            samples = [dataset[epoch_index(i, n, self.cfg.seed)] for i in indices]
            batch = collate(samples, self.cfg.reset_attention_mask)
            batch = self.batch_transform(batch) if self.batch_transform else batch
            # CP: every rank of a CP group read the same samples; keep its zigzag share.
            batches.append(zigzag_batch(batch, self.cp_size, self.cp_rank, self.cfg.pad_to_multiple))
        return batches

    def shift_for(self, batch: Batch):
        """The MTP losses' shift along the sequence: across CP ranks under CP."""
        if self.cp_size == 1:
            return shift_left
        layout = ZigzagLayout.for_local_tokens(batch.tokens.shape[1], self.cp_size, batch.packed_seq_params)
        group = parallel_state.get_context_parallel_group()
        return lambda x, depth, fill: cp_shift_left(x, depth, fill, layout, self.cp_rank, group)

    # ---- one update ---------------------------------------------------------
    def forward(self, batch: Batch) -> ModelOutput:
        if self.pre_forward is not None:
            self.pre_forward(batch)
        logits, mtp_logits = composer_forward(self.model.module, batch.tokens, batch.position_ids,
                                              batch.packed_seq_params, batch.padding_mask)
        return ModelOutput(logits, mtp_logits)

    def _all_reduce_dp_cp(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized():
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return t

    def global_counts(self, batches: list[Batch], shifts: list) -> torch.Tensor:
        """[num plug-ins] positions of the whole global batch, float64."""
        counts = torch.zeros(len(self.loss_plugins), dtype=torch.float64, device=self.device)
        for batch, shift in zip(batches, shifts):
            counts += torch.stack([p.count(batch, shift).double() for p in self.loss_plugins])
        return self._all_reduce_dp_cp(counts)

    def forward_backward(self, batch: Batch, shift, denominators: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one device micro-batch; [num plug-ins] float64 loss sums (detached).

        `denominators`: each plug-in's position count over the whole update (`global_counts`), so the
        gradients of the micro-batches add up to the gradient of the update's per-position means."""
        out = self.forward(batch)
        sums = [p.loss_sum(batch, out, shift) for p in self.loss_plugins]
        loss = sum(p.scale * s / n for p, s, n in zip(self.loss_plugins, sums, denominators))
        if loss.requires_grad:
            loss.backward()
        return torch.stack([s.detach().double() for s in sums])

    def update(self, micro_batches: list[Batch]) -> StepResult:
        """One optimizer update on `micro_batches` (this rank's, on the host): steps 2-6 of the module
        docstring. The loop state does not move (`advance`); RL's PPO mini-batches take several
        updates per step."""
        start = time.perf_counter()
        self.model.train()
        shifts = [self.shift_for(b) for b in micro_batches]  # plans read cu_seqlens on the host
        batches = [b.to(self.device) for b in micro_batches]
        counts = self.global_counts(batches, shifts)
        # fp32: the Python floats they replace entered the fp32 loss ops as fp32 too (exact: counts
        # < 2**24); no host sync before the forward
        denominators = counts.clamp(min=1.0).float()
        totals = torch.zeros(len(self.loss_plugins), dtype=torch.float64, device=self.device)
        self.model.zero_grad()  # the gradient buffer is zeroed here only, once per update
        for i, (batch, shift) in enumerate(zip(batches, shifts)):
            # gradients accumulate locally; the reduce starts in the last micro-batch's backward
            with self.model.no_sync(i < len(batches) - 1):
                totals += self.forward_backward(batch, shift, denominators)
        self.model.finalize_grads()
        totals = self._all_reduce_dp_cp(totals)
        lr = self.optimizer.set_lr(self.state.iteration)
        applied, norm, _ = self.optimizer.step()  # host sync 1: the gradient norm
        # host sync 2: the logged values, with the new weights' finite check (raises if not)
        logged = self.optimizer.check_finite(torch.cat([totals, counts.clamp(min=1.0)]))
        self.model.update_expert_bias(applied)
        n = len(self.loss_plugins)
        losses = {p.name: (t / c) for p, t, c in zip(self.loss_plugins, logged[:n], logged[n:])}
        return StepResult(losses=losses, grad_norm=norm, tokens=self.global_batch_size * self.cfg.seq_length,
                          skipped=not applied, lr=lr, seconds=time.perf_counter() - start)

    def advance(self, applied: bool, samples: int) -> None:
        """The loop state after one training step of `samples` samples."""
        st = self.state
        st.iteration += 1
        st.consumed_samples += samples
        st.skipped_iterations += not applied
        st.consecutive_skipped = 0 if applied else st.consecutive_skipped + 1

    def train_step(self, micro_batches: list[Batch], *, samples: Optional[int] = None) -> StepResult:
        """One training step on the micro-batches it is handed (this rank's, on the host): one update,
        then the loop state moves on by `samples` (default: the global batch size)."""
        result = self.update(micro_batches)
        self.advance(not result.skipped, self.global_batch_size if samples is None else samples)
        return result

    def step(self) -> StepResult:
        """One step of the stage's own data: this rank's micro-batches of the next global batch."""
        return self.train_step(self.micro_batches(self.state.consumed_samples))

    @torch.no_grad()
    def evaluate(self, dataset, iters: int) -> float:
        """Per-token LM loss on `iters` global batches of `dataset` (from its start)."""
        self.model.eval()
        lm = self.loss_plugins[0]
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            for i in range(iters):
                for batch in self.micro_batches(i * self.global_batch_size, dataset):
                    batch = batch.to(self.device)
                    out = self.forward(batch)
                    total += torch.stack([lm.loss_sum(batch, out, shift_left).double(),
                                          lm.count(batch, shift_left).double()])
        finally:
            self.model.train()
        self._all_reduce_dp_cp(total)
        return (total[0] / total[1].clamp(min=1)).item()

    def run_base_eval(self) -> dict:
        """The base evals on the current weights (every rank its share), logged at this iteration."""
        try:
            result = self.base_eval(self.model, self.model_cfg)
        finally:
            self.model.train()
        self.log.base_eval(self.state.iteration, result)
        return result

    # ---- the outer loop -----------------------------------------------------
    def train(self) -> TrainState:
        """Step until --train-iters: log every --log-interval, evaluate every
        --eval-interval, run the base evals every --eval-base-interval, save
        every --save-interval and at the end.

        Stops with `TrainingAborted` after --max-skipped-iterations consecutive
        skipped steps, and with `optim.NonFiniteParametersError` if an update
        made weights non-finite; neither saves a checkpoint."""
        cfg, st = self.cfg, self.state
        window: list[StepResult] = []
        if self.cfg.checkpoint.save:
            self.checkpoints.prepare_save_dir()
        while st.iteration < cfg.train_iters:
            result = self.step()
            window.append(result)
            if st.consecutive_skipped >= cfg.max_skipped_iterations:
                raise TrainingAborted(
                    f"{st.consecutive_skipped} consecutive iterations skipped (non-finite gradient norm "
                    f"{result.grad_norm}) at iteration {st.iteration}; the last checkpoint is intact. "
                    f"Lower --lr ({cfg.optimizer.lr}) or check the data; --max-skipped-iterations "
                    f"{cfg.max_skipped_iterations} sets how many are tolerated")
            if st.iteration % cfg.log_interval == 0 or st.iteration == cfg.train_iters:
                self.log.log_iteration(self, window)
                window = []
            if cfg.eval_interval and self.data.valid is not None and st.iteration % cfg.eval_interval == 0:
                self.log.validation(st.iteration, self.evaluate(self.data.valid, cfg.eval_iters))
            if self.base_eval is not None and cfg.eval_base_interval and st.iteration % cfg.eval_base_interval == 0:
                self.run_base_eval()
            interval = cfg.checkpoint.save_interval
            if cfg.checkpoint.save and interval and st.iteration % interval == 0:
                self.checkpoints.save()
        if cfg.checkpoint.save and not (cfg.checkpoint.save_interval and st.iteration % cfg.checkpoint.save_interval == 0):
            self.checkpoints.save()
        if self.data.valid is not None:
            self.log.validation(None, self.evaluate(self.data.valid, cfg.eval_iters))
        return st

    def resume(self) -> None:
        """Load --load (see `training.checkpointer.Checkpointer.resume`)."""
        self.checkpoints.resume()
