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
        if not self.lr >= 0:  # 0: the weights stay as loaded (an RL control arm: same sampling, no learning)
            raise ValueError(f"--lr must be >= 0, got {self.lr}")
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
    overwrite_save: bool = False  # move an earlier run in --save aside (`checkpoint.guard`) instead of refusing
    # the tokenizer's model file, copied into --save so that a checkpoint carries its tokenizer
    # (`checkpoint.checkpoint_tokenizer`); --tokenizer-model, or what the entry point resolved
    tokenizer_model: Optional[str] = None

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


TRANSFORMER_IMPLS = ("transformer_engine", "local")
FP8_RECIPES = ("tensorwise", "blockwise", "mxfp8")
FP4_RECIPES = ("nvfp4",)
TE_PRECISION_SCOPES = ("experts", "all")


@dataclass(frozen=True)
class TransformerImplConfig:
    """Which modules the layers are built from, and Transformer Engine's low-precision recipe.

    `local`: megatron-core's own modules (any device); `transformer_engine`:
    TE linears, norms and attention (CUDA). A TE recipe (`--fp8-format` +
    `--fp8-recipe`, or `--fp4-format` + `--fp4-recipe`, Megatron-LM's flags)
    quantizes the routed experts' GEMMs only (`te_precision_scope` "experts")
    or every TE linear ("all"); Megatron-LM's `--te-precision-config-file`
    (a YAML of megatron-core quantization matchers) replaces either."""

    transformer_impl: str = "local"  # the command line's default: transformer_engine when TE imports
    fp8_format: Optional[str] = None  # "e4m3"
    fp8_recipe: Optional[str] = None  # FP8_RECIPES
    fp4_format: Optional[str] = None  # "e2m1"
    fp4_recipe: Optional[str] = None  # FP4_RECIPES
    te_precision_scope: str = "experts"
    te_precision_config_file: Optional[str] = None

    def __post_init__(self):
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl {self.transformer_impl!r}; use one of {', '.join(TRANSFORMER_IMPLS)}")
        if self.te_precision_scope not in TE_PRECISION_SCOPES:
            raise ValueError(f"--te-precision-scope {self.te_precision_scope!r}; use experts or all")
        for kind, fmt, recipe, formats, recipes in (
                ("fp8", self.fp8_format, self.fp8_recipe, ("e4m3",), FP8_RECIPES),
                ("fp4", self.fp4_format, self.fp4_recipe, ("e2m1",), FP4_RECIPES)):
            if fmt is not None and fmt not in formats:
                raise ValueError(f"--{kind}-format {fmt!r}; use {', '.join(formats)}")
            if recipe is not None and recipe not in recipes:
                raise ValueError(f"--{kind}-recipe {recipe!r}; use one of {', '.join(recipes)}")
            if (fmt is None) != (recipe is None):
                raise ValueError(f"--{kind}-format and --{kind}-recipe go together, got format {fmt} and "
                                 f"recipe {recipe}; e.g. --{kind}-format {formats[0]} --{kind}-recipe {recipes[0]}")
        if self.fp8_format and self.fp4_format:
            raise ValueError(f"--fp8-format {self.fp8_format} and --fp4-format {self.fp4_format} are exclusive; "
                             f"choose one recipe")
        if self.transformer_impl == "local" and (self.te_recipe or self.te_precision_config_file):
            flag = (f"--fp8-recipe {self.fp8_recipe}" if self.fp8_recipe else f"--fp4-recipe {self.fp4_recipe}"
                    if self.fp4_recipe else "--te-precision-config-file")
            raise ValueError(f"{flag} runs through Transformer Engine; add --transformer-impl transformer_engine, "
                             f"or use --moe-expert-precision nvfp4/mxfp8 (our exact emulation) with local")

    @property
    def te_recipe(self) -> Optional[str]:
        """The recipe's name in `platform.recipes` ("fp8-blockwise", ...), None without one."""
        if self.fp8_recipe:
            return f"fp8-{self.fp8_recipe}"
        return f"fp4-{self.fp4_recipe}" if self.fp4_recipe else None

    @classmethod
    def from_args(cls, args) -> "TransformerImplConfig":
        return _from_namespace(cls, args)


RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute, Megatron-LM's flags and meanings (megatron-core does the work).

    `full` recomputes whole layers: `uniform` in chunks of `recompute_num_layers`
    layers, `block` the first `recompute_num_layers` layers. `selective`
    recomputes the `recompute_modules` inside each layer (default core_attn)."""

    recompute_granularity: Optional[str] = None  # "full" | "selective"
    recompute_method: Optional[str] = None  # "uniform" | "block" (full only)
    recompute_num_layers: Optional[int] = None  # full only
    recompute_modules: Optional[tuple] = None  # selective only; default ("core_attn",)

    def __post_init__(self):
        g, method, n, modules = (self.recompute_granularity, self.recompute_method, self.recompute_num_layers,
                                 self.recompute_modules)
        if g not in (None, "full", "selective"):
            raise ValueError(f"--recompute-granularity {g!r}; use full or selective")
        if method not in (None, "uniform", "block"):
            raise ValueError(f"--recompute-method {method!r}; use uniform or block")
        if g == "full" and (method is None or n is None):
            raise ValueError(f"--recompute-granularity full needs --recompute-method uniform|block and "
                             f"--recompute-num-layers N, got method {method} and num layers {n}")
        if g != "full" and (method is not None or n is not None):
            raise ValueError(f"--recompute-method {method} / --recompute-num-layers {n} apply to "
                             f"--recompute-granularity full only, got {g}; drop them or use full")
        if n is not None and n < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {n}")
        if modules is not None:
            if g != "selective":
                raise ValueError(f"--recompute-modules {' '.join(modules)} needs --recompute-granularity "
                                 f"selective, got {g}")
            bad = [m for m in modules if m not in RECOMPUTE_MODULES]
            if bad or not modules:
                raise ValueError(f"--recompute-modules {' '.join(bad) or '(empty)'}: use some of "
                                 f"{', '.join(RECOMPUTE_MODULES)}")

    def check_layers(self, num_layers: int) -> None:
        """Raise if `recompute_num_layers` does not fit a model of `num_layers` layers."""
        n = self.recompute_num_layers
        if n is not None and n > num_layers:
            raise ValueError(f"--recompute-num-layers {n} is more than the model's {num_layers} layers; "
                             f"use 1..{num_layers}")

    @classmethod
    def from_args(cls, args) -> "RecomputeConfig":
        values = _from_namespace(cls, args)
        if values.recompute_modules is not None:  # argparse gives a list; keep the config hashable
            values = dataclasses.replace(values, recompute_modules=tuple(values.recompute_modules))
        return values


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
    # ddp: each gradient bucket's all-reduce starts in the backward (megatron-core's overlap_grad_reduce)
    overlap_grad_reduce: bool = True
    ddp_bucket_size: Optional[int] = None  # parameters per bucket; None: megatron's max(4e7, 1e6 x DP)
    # intervals and stop conditions
    log_interval: int = 1
    eval_interval: Optional[int] = None
    eval_iters: int = 4
    eval_base_interval: int = 0  # base evals (codebase ppl, state tracking, knowledge) every N; 0 = off
    max_skipped_iterations: int = 5  # consecutive non-finite steps before the run stops
    distributed_timeout_minutes: int = 10  # process groups' collective timeout
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    moe_precision: MoEPrecisionConfig = field(default_factory=MoEPrecisionConfig)
    transformer: TransformerImplConfig = field(default_factory=TransformerImplConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)

    def __post_init__(self):
        for name in ("seq_length", "micro_batch_size", "train_iters", "log_interval", "eval_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.eval_base_interval < 0:
            raise ValueError(f"--eval-base-interval must be >= 0 (0 turns the base evals off), got "
                             f"{self.eval_base_interval}")
        if self.max_skipped_iterations < 1:
            raise ValueError(f"--max-skipped-iterations must be >= 1, got {self.max_skipped_iterations}")
        if self.mtp_loss not in ("self-distill", "ce"):
            raise ValueError(f"--mtp-loss {self.mtp_loss!r}; use self-distill or ce")
        if self.data_parallel_sharding not in ("ddp", "hsdp"):
            raise ValueError(f"--data-parallel-sharding {self.data_parallel_sharding!r}; use ddp or hsdp")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1 parameter, got {self.ddp_bucket_size}; "
                             "leave it out for megatron's default")

    def replace(self, **changes) -> "TrainingConfig":
        return dataclasses.replace(self, **changes)

    def with_tokenizer(self, tokenizer_model) -> "TrainingConfig":
        """This config with the tokenizer model its checkpoints carry (`CheckpointConfig.tokenizer_model`)."""
        path = None if tokenizer_model is None else str(tokenizer_model)
        return self.replace(checkpoint=dataclasses.replace(self.checkpoint, tokenizer_model=path))

    @classmethod
    def from_args(cls, args) -> "TrainingConfig":
        return _from_namespace(
            cls, args,
            optimizer=OptimizerConfig.from_args(args),
            checkpoint=CheckpointConfig.from_args(args),
            moe_precision=MoEPrecisionConfig.from_args(args),
            transformer=TransformerImplConfig.from_args(args),
            recompute=RecomputeConfig.from_args(args),
        )
