"""Command line of `pretrain_cpt.py`, with Megatron-LM's flag names.

Flags that Megatron-LM has keep its names and meanings (`--seq-length`,
`--micro-batch-size`, `--expert-model-parallel-size`, ...). Model-shape flags
override fields of the `--model-preset`. The `--stage` fills in what the
stage decides (sequence length, data, losses) unless given explicitly.
Each flag's destination is the field name of the typed config it fills
(`config.TrainingConfig` and its nested configs, `config.ModelConfig`).

`parse_args` leaves argparse's own errors (unknown flags, bad types) to
argparse; every check of values raises `ValueError` naming the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from ..config import PRESETS, STAGES, ModelConfig, TrainingConfig, get_preset, stage_seq_length
from ..config.training import (
    FP4_RECIPES,
    FP8_RECIPES,
    RECOMPUTE_MODULES,
    TE_PRECISION_SCOPES,
    TRANSFORMER_IMPLS,
)


# Model flags: CLI name -> ModelConfig field.
_MODEL_FLAGS = {
    "num_layers": int,
    "hidden_size": int,
    "ffn_hidden_size": int,
    "num_attention_heads": int,
    "q_lora_rank": int,
    "kv_lora_rank": int,
    "qk_head_dim": int,
    "qk_pos_emb_head_dim": int,
    "v_head_dim": int,
    "num_experts": int,
    "moe_ffn_hidden_size": int,
    "moe_router_topk": int,
    "moe_shared_expert_intermediate_size": int,
    "moe_router_num_groups": int,
    "moe_router_group_topk": int,
    "moe_router_topk_scaling_factor": float,
    "first_k_dense_layers": int,
    "mtp_num_layers": int,
    "rotary_base": float,
}


def _default_transformer_impl() -> str:
    from ..models.te_spec import have_transformer_engine

    return "transformer_engine" if have_transformer_engine() else "local"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_cpt.py",
        description="Composer CPT / long-context / SFT training on megatron-core.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("stage and model")
    g.add_argument("--stage", choices=sorted(STAGES), default="cpt-32k")
    g.add_argument("--model-preset", default="tiny", help=f"one of {', '.join(PRESETS)}")
    for name, typ in _MODEL_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None,
                       help=f"override the preset's {name}")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and compute for forward and backward; fp32 main weights, "
                        "gradient accumulation and optimizer state")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None,
                   help="indexed dataset prefix (.bin/.idx) for CPT, or chat JSONL for SFT; "
                        "default: the embedded Python-stdlib corpus")
    g.add_argument("--valid-data-path", default=None, help="held-out data (same format)")
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece .model")
    g.add_argument("--data-cache-dir", default="data",
                   help="where the embedded corpus is tokenized and cached")
    g.add_argument("--seq-length", type=int, default=None, help="default: set by --stage")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="attend within each packed document only (cu_seqlens)")
    g.add_argument("--pad-to-multiple", action="store_true",
                   help="under CP, pad each sequence (each packed document with "
                        "--reset-attention-mask) to a multiple of 2*CP with loss-masked pad "
                        "tokens instead of refusing it")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--optimizer", choices=["adam", "muon"], default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--muon-momentum", type=float, default=0.95)
    g.add_argument("--muon-nesterov", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--muon-ns-steps", type=int, default=5)
    g.add_argument("--muon-adjust-lr", choices=["original", "match_rms_adamw"],
                   default="match_rms_adamw")
    g.add_argument("--muon-granularity", choices=["matrix", "head"], default="head",
                   help="orthogonalize whole matrices or per attention head / per expert")
    g.add_argument("--mtp-loss", choices=["self-distill", "ce"], default="self-distill",
                   help="MTP objective: distill the main head (Composer) or plain CE (DeepSeek-V3)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1)
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="cross-entropy through megatron-core's fused vocab-parallel kernels (chunked)")
    g.add_argument("--mtp-freeze-trunk", action="store_true",
                   help="train only the MTP modules (MTP added to a mid-CPT checkpoint)")
    g.add_argument("--max-skipped-iterations", type=int, default=5,
                   help="stop the run after this many consecutive iterations skipped for a "
                        "non-finite gradient norm")

    g = p.add_argument_group("low precision")
    g.add_argument("--moe-expert-precision", choices=["bf16", "mxfp8", "nvfp4"], default="bf16",
                   help="routed-expert GEMMs: bf16 = unquantized, in the model's dtype (fp32, or "
                        "bf16 with --bf16); mxfp8; or nvfp4 (per-token-scaled NVFP4 forward, MXFP8 "
                        "backward); the quantized ones are an exact emulation")
    g.add_argument("--moe-dispatch-precision", choices=["bf16", "mxfp8"], default="bf16",
                   help="EP alltoall dispatch payload: mxfp8 sends E4M3 data + E8M0 scales "
                        "(hidden size a multiple of 32); combine stays bf16")

    g = p.add_argument_group("transformer engine")
    g.add_argument("--transformer-impl", choices=list(TRANSFORMER_IMPLS), default=_default_transformer_impl(),
                   help="layer modules: transformer_engine (TE linears, norms, attention; CUDA) or local "
                        "(megatron-core's own; any device); default: transformer_engine when it imports")
    g.add_argument("--fp8-format", choices=["e4m3"], default=None,
                   help="FP8 through TE (with --fp8-recipe); routed experts only unless --te-precision-scope all")
    g.add_argument("--fp8-recipe", choices=list(FP8_RECIPES), default=None,
                   help="tensorwise (Ada+), blockwise (Hopper+), mxfp8 (Blackwell B200/B300)")
    g.add_argument("--fp4-format", choices=["e2m1"], default=None, help="FP4 through TE (with --fp4-recipe)")
    g.add_argument("--fp4-recipe", choices=list(FP4_RECIPES), default=None, help="nvfp4 (Blackwell B200/B300)")
    g.add_argument("--te-precision-scope", choices=list(TE_PRECISION_SCOPES), default="experts",
                   help="which TE linears the FP8/FP4 recipe quantizes: the routed experts, or all")
    g.add_argument("--te-precision-config-file", default=None,
                   help="megatron-core per-module quantization YAML (configs + glob matchers); "
                        "replaces --te-precision-scope")

    g = p.add_argument_group("activation recompute")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: whole layers (with --recompute-method / --recompute-num-layers); "
                        "selective: the --recompute-modules of each layer")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: uniform = chunks of N layers, block = the first N layers")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="N for --recompute-method")
    g.add_argument("--recompute-modules", nargs="+", choices=list(RECOMPUTE_MODULES), default=None,
                   help="selective recompute: the submodules to recompute (default: core_attn)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1)
    g.add_argument("--data-parallel-sharding", choices=["ddp", "hsdp"], default="ddp",
                   help="ddp: megatron-core DDP (replicated weights); hsdp: torch FSDP2 with "
                        "dual meshes (dense weights over --dense-shard-size ranks incl. CP, "
                        "experts over the expert-data-parallel ranks)")
    g.add_argument("--dense-shard-size", type=int, default=None,
                   help="HSDP shard group size for dense weights (a multiple of CP); "
                        "default: max(CP, 2)")
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="ddp: start each gradient bucket's all-reduce in the last micro-batch's backward, "
                        "as soon as the bucket's gradients are complete (same sums as one all-reduce after it)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="ddp: parameters per gradient bucket of the overlapped reduce "
                        "(default: max(40M, 1M x data-parallel size))")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="timeout of collectives: a rank that stops makes the others fail after "
                        "this long instead of hanging")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory to write; one that holds a checkpoint "
                   "is refused unless it is also --load (resume) or --overwrite-save is given")
    g.add_argument("--overwrite-save", action="store_true",
                   help="start over in a --save that holds an earlier run: move its contents to "
                        "SAVE/overwritten-<time>/ first (nothing is deleted)")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only and restart iteration count, data and optimizer")
    g.add_argument("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
                   help="skip the per-file checksum check when loading")
    g.add_argument("--continue-on-save-failure", dest="exit_on_save_failure", action="store_false",
                   help="keep training when a checkpoint cannot be written (default: stop, "
                        "keeping the previous checkpoint)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--eval-base-interval", type=int, default=0,
                   help="run the base evals (codebase perplexity, state tracking, coding knowledge; "
                        "tools/eval_base.py) every N iterations and log them; 0: off")
    g.add_argument("--eval-base-samples", type=int, default=8,
                   help="base evals during training: at most this many perplexity windows, "
                        "state-tracking tasks and knowledge questions")
    g.add_argument("--eval-base-evals", default="codebase-ppl,state-tracking,knowledge",
                   help="comma-separated base evals to run")
    g.add_argument("--eval-base-data", default=None,
                   help="source directory of the base evals; default: the held-out split of the "
                        "embedded corpus")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None, help="enables wandb (offline unless WANDB_MODE)")
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    return p


def explicit_model_overrides(args) -> dict:
    """ModelConfig fields given explicitly on the command line."""
    return {k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k, None) is not None}


def model_config_from_args(args) -> ModelConfig:
    cfg = get_preset(args.model_preset)
    overrides = explicit_model_overrides(args)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    cfg.validate()
    return cfg


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the model config comes from: the preset, the shape flags given explicitly, and --load's
    saved architecture (`resolve_model_config`)."""

    preset: str = "tiny"
    overrides: tuple = ()  # (field, value) pairs of the explicit shape flags
    load: Optional[str] = None

    @classmethod
    def from_args(cls, args) -> "ModelSource":
        return cls(args.model_preset, tuple(sorted(explicit_model_overrides(args).items())), args.load)


def resolve_model_config(source: ModelSource, vocab_size: int) -> ModelConfig:
    """The one model-config resolver of both entry points: --load's saved architecture (else the preset)
    with the explicit shape flags on top (so --mtp-num-layers 1 adds MTP to a checkpoint without it),
    the vocabulary grown to the tokenizer's (the tiny preset takes the tokenizer's exactly)."""
    from .. import checkpoint as ckpt
    from ..config import model_config_from_dict
    from ..config.stages import tokenizer_sets_vocab

    overrides = dict(source.overrides)
    cfg = None
    if source.load and ckpt.load_target_kind(source.load) == "checkpoint":
        meta = ckpt.read_meta(source.load)
        if "model_config" in meta:
            cfg = model_config_from_dict(meta["model_config"]).replace(**overrides)
    if cfg is None:
        cfg = dataclasses.replace(get_preset(source.preset), **overrides)
        cfg.validate()
    if vocab_size > cfg.vocab_size or (tokenizer_sets_vocab(source.preset) and vocab_size != cfg.vocab_size):
        cfg = cfg.replace(vocab_size=vocab_size)
    return cfg


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """The Megatron parallel-size flags (`parallel.ParallelLayout.from_sizes` reads these names)."""

    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1

    @classmethod
    def from_args(cls, args) -> "ParallelSizes":
        return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__})


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """TensorBoard and wandb destinations (`training.logger.TrainingLogger`)."""

    tensorboard_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None

    @classmethod
    def from_args(cls, args) -> "LoggingConfig":
        return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__})

    def logger(self, rank: int, **kwargs):
        from .logger import TrainingLogger

        return TrainingLogger(rank, tensorboard_dir=self.tensorboard_dir, wandb_project=self.wandb_project,
                              wandb_name=self.wandb_exp_name, wandb_dir=self.wandb_save_dir, **kwargs)


def parse_args(argv: Optional[list[str]] = None, parser: Optional[argparse.ArgumentParser] = None):
    """Parse and validate; raise ValueError naming the bad flag and value. `parser`: this
    module's parser with more flags (`train_rl.py` adds its own group)."""
    args = (parser or build_parser()).parse_args(argv)
    if args.model_preset not in PRESETS:
        raise ValueError(f"unknown --model-preset {args.model_preset!r}; choose one of: {', '.join(PRESETS)}")
    if args.seq_length is None:
        args.seq_length = stage_seq_length(args.stage, args.model_preset)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    for name in ("tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "distributed_timeout_minutes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pipeline_model_parallel_size != 1:
        raise ValueError("--pipeline-model-parallel-size > 1 is not supported; the recipe uses "
                         "CP x EP x FSDP instead of PP")
    if args.context_parallel_size > 1 and not args.pad_to_multiple:
        from ..parallel import check_divisible

        try:
            check_divisible([args.seq_length], args.context_parallel_size, packed=False)
        except ValueError as exc:
            raise ValueError(f"--seq-length: {exc}") from None
    if args.optimizer == "muon" and args.tensor_model_parallel_size > 1:
        raise ValueError(f"--optimizer muon orthogonalizes whole matrices, which --tensor-model-parallel-size "
                         f"{args.tensor_model_parallel_size} shards; use --optimizer adam with TP, or TP 1 "
                         f"(the recipe scales with CP x EP x FSDP)")
    cfg = TrainingConfig.from_args(args)  # validates the values
    model_cfg = model_config_from_args(args)
    from ..models.builder import check_expert_tensor_parallel

    check_expert_tensor_parallel(model_cfg.num_moe_layers > 0, args.tensor_model_parallel_size,
                                 args.expert_model_parallel_size, args.expert_tensor_parallel_size)
    check_low_precision(args, model_cfg)
    check_transformer_impl(cfg, model_cfg)
    check_base_evals(args, cfg)
    return args


def check_base_evals(args, cfg: TrainingConfig) -> None:
    """Raise a ValueError naming the flag if the base evals cannot run with this layout.

    They run through the inference engine's forward on whole weights on every rank."""
    if not cfg.eval_base_interval:
        return
    from ..eval import parse_evals

    parse_evals(args.eval_base_evals)
    if args.eval_base_samples < 1:
        raise ValueError(f"--eval-base-samples must be >= 1, got {args.eval_base_samples}")
    for flag, value, fits in (("--tensor-model-parallel-size", args.tensor_model_parallel_size, 1),
                              ("--expert-model-parallel-size", args.expert_model_parallel_size, 1),
                              ("--data-parallel-sharding", args.data_parallel_sharding, "ddp"),
                              ("--transformer-impl", args.transformer_impl, "local")):
        if value != fits:
            raise ValueError(f"--eval-base-interval runs the evals on whole weights on every rank (the inference "
                             f"engine's forward); {flag} {value} does not allow it; use {flag} {fits} or "
                             f"evaluate saved checkpoints with tools/eval_base.py")


def check_transformer_impl(cfg: TrainingConfig, model_cfg: ModelConfig) -> None:
    """Raise a ValueError naming the flag if the implementation, TE recipe or
    recompute choice cannot run here or contradicts another flag."""
    import torch

    from ..models.te_spec import check_te_choices, require_transformer_engine
    from ..platform.recipes import check_recipe_on_this_gpu

    impl = cfg.transformer
    cfg.recompute.check_layers(model_cfg.num_layers)
    if impl.transformer_impl == "transformer_engine":
        require_transformer_engine()
    check_te_choices(impl, cfg.recompute, cfg.moe_precision.moe_expert_precision)
    if impl.te_recipe and torch.cuda.is_available():
        check_recipe_on_this_gpu(impl.te_recipe)


def check_low_precision(args, cfg: ModelConfig) -> None:
    """Raise a ValueError naming the size if the model cannot run the chosen MoE precisions."""
    if not cfg.num_experts:
        return
    from ..moe import check_dispatch_hidden_size, check_expert_precision

    check_expert_precision(cfg.hidden_size, cfg.moe_ffn_hidden_size, args.moe_expert_precision,
                           expert_tp=args.expert_tensor_parallel_size)
    if args.moe_dispatch_precision == "mxfp8":
        check_dispatch_hidden_size(cfg.hidden_size)
