"""Typed configs of a training run, built once from the parsed command line.

`TrainingConfig` holds the loop's settings and nests the optimizer,
checkpoint and MoE-precision configs. Every field is named like the
Megatron-style flag it comes from (`--micro-batch-size` -> `micro_batch_size`),
so `from_args` fills each config by field name and a new flag needs only a
new field. Objects take a config, not dozens of keyword arguments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


def _from_namespace(cls, args, **nested):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.name not in nested and hasattr(args, f.name)}
    return cls(**values, **nested)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, or Muon for hidden matrices + AdamW for the rest (`optim.build_optimizer`)."""

    optimizer: str = "adam"  # "adam" | "muon"
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 0
    lr_decay_iters: int = 100
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"
    muon_granularity: str = "head"

    def __post_init__(self):
        if self.optimizer not in ("adam", "muon"):
            raise ValueError(f"--optimizer {self.optimizer!r}; use adam or muon")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.min_lr < 0:
            raise ValueError(f"--min-lr must be >= 0, got {self.min_lr}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is larger than --lr {self.lr}; "
                             f"use --min-lr <= {self.lr}")
        if self.adam_eps < 0:
            raise ValueError(f"--adam-eps must be >= 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")

    @property
    def betas(self) -> tuple[float, float]:
        return (self.adam_beta1, self.adam_beta2)

    @classmethod
    def from_args(cls, args) -> "OptimizerConfig":
        return _from_namespace(cls, args)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and when checkpoints are written and what a load restores."""

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    finetune: bool = False
    verify_checkpoint: bool = True  # --no-verify-checkpoint skips the checksums
    exit_on_save_failure: bool = True  # --continue-on-save-failure keeps training

    @classmethod
    def from_args(cls, args) -> "CheckpointConfig":
        return _from_namespace(cls, args)


@dataclass(frozen=True)
class MoEPrecisionConfig:
    """Number formats of the routed experts' GEMMs and of the EP dispatch.

    `bf16` means unquantized: the GEMMs run in the model's dtype (fp32, or
    bf16 with --bf16)."""

    moe_expert_precision: str = "bf16"  # "bf16" | "mxfp8" | "nvfp4"
    moe_dispatch_precision: str = "bf16"  # "bf16" | "mxfp8"

    @classmethod
    def from_args(cls, args) -> "MoEPrecisionConfig":
        return _from_namespace(cls, args)


@dataclass(frozen=True)
class TrainingConfig:
    """One run of the shared training loop (CPT, long-context CPT, SFT; RL reuses it)."""

    seq_length: int = 512
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # default: micro batch x DP size
    train_iters: int = 100
    seed: int = 1234
    bf16: bool = False  # bf16 compute and parameters, fp32 main weights, grads and optimizer state
    stage: str = "cpt-32k"
    model_preset: str = "tiny"
    # losses
    mtp_loss: str = "self-distill"  # "self-distill" | "ce"
    mtp_loss_scaling_factor: float = 0.1
    cross_entropy_loss_fusion: bool = False  # megatron-core's fused cross-entropy for the CE losses
    mtp_freeze_trunk: bool = False
    # batches
    reset_attention_mask: bool = False
    pad_to_multiple: bool = False
    # data-parallel sharding
    data_parallel_sharding: str = "ddp"  # "ddp" | "hsdp"
    dense_shard_size: Optional[int] = None
    # intervals and stop conditions
    log_interval: int = 1
    eval_interval: Optional[int] = None
    eval_iters: int = 4
    max_skipped_iterations: int = 5  # consecutive non-finite steps before the run stops
    distributed_timeout_minutes: int = 10  # process groups' collective timeout
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    moe_precision: MoEPrecisionConfig = field(default_factory=MoEPrecisionConfig)

    def __post_init__(self):
        for name in ("seq_length", "micro_batch_size", "train_iters", "log_interval", "eval_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_skipped_iterations < 1:
            raise ValueError(f"--max-skipped-iterations must be >= 1, got {self.max_skipped_iterations}")
        if self.mtp_loss not in ("self-distill", "ce"):
            raise ValueError(f"--mtp-loss {self.mtp_loss!r}; use self-distill or ce")
        if self.data_parallel_sharding not in ("ddp", "hsdp"):
            raise ValueError(f"--data-parallel-sharding {self.data_parallel_sharding!r}; use ddp or hsdp")

    def replace(self, **changes) -> "TrainingConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls, args) -> "TrainingConfig":
        return _from_namespace(
            cls, args,
            optimizer=OptimizerConfig.from_args(args),
            checkpoint=CheckpointConfig.from_args(args),
            moe_precision=MoEPrecisionConfig.from_args(args),
        )
