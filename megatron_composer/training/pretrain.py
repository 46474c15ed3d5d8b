"""`pretrain_cpt.py`'s body: build everything from args and run the loop."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..config.model import count_parameters
from ..models import ParallelSizes
from ..platform import init_distributed
from . import checkpointing
from .arguments import STAGES, explicit_model_overrides, model_config_from_args, parse_args
from .data import build_datasets
from .logger import TrainingLogger
from .loop import Trainer


def parallel_sizes(args) -> ParallelSizes:
    return ParallelSizes(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )


def optimizer_factory(args):
    """None for AdamW (the loop's default); a builder for Muon + AdamW."""
    if args.optimizer == "adam":
        return None
    from ..optim.factory import build_muon_optimizer

    return lambda model: build_muon_optimizer(
        model, lr=args.lr, weight_decay=args.weight_decay, momentum=args.muon_momentum,
        nesterov=args.muon_nesterov, ns_steps=args.muon_ns_steps, adjust_lr_fn=args.muon_adjust_lr,
        granularity=args.muon_granularity, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)


def build_trainer(args, train_ds, model_cfg) -> Trainer:
    return Trainer(
        model_cfg,
        parallel_sizes(args),
        train_ds,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_iters=args.lr_warmup_iters,
        decay_iters=args.lr_decay_iters,
        decay_style=args.lr_decay_style,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        clip_grad=args.clip_grad,
        seed=args.seed,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        mtp_loss=args.mtp_loss,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        mtp_freeze_trunk=args.mtp_freeze_trunk,
        reset_attention_mask=args.reset_attention_mask,
        pad_to_multiple=args.pad_to_multiple,
        optimizer_factory=optimizer_factory(args),
        data_parallel_sharding=args.data_parallel_sharding,
        dense_shard_size=args.dense_shard_size,
        moe_expert_precision=args.moe_expert_precision,
        moe_dispatch_precision=args.moe_dispatch_precision,
    )


def saved_model_config(args):
    """The architecture stored in --load's checkpoint, with the shape flags given
    explicitly on top (so --mtp-num-layers 1 adds MTP to a checkpoint without
    it); None when there is nothing to load."""
    if not args.load or checkpointing.latest_iteration(args.load) is None:
        return None
    meta = checkpointing.read_meta(args.load)
    if "model_config" not in meta:
        return None
    from ..convert.config import model_config_from_dict

    return model_config_from_dict(meta["model_config"]).replace(**explicit_model_overrides(args))


def _resume(args, trainer: Trainer, log: TrainingLogger) -> None:
    if not args.load:
        return
    if checkpointing.latest_iteration(args.load) is None:
        log.print(f"WARNING: no checkpoint found in --load {args.load}; training from scratch")
        return
    # A checkpoint of an earlier stage (cpt-32k -> cpt-256k) starts the new
    # stage from its weights: like --finetune, a fresh optimizer, iteration and data.
    saved_stage = checkpointing.read_meta(args.load).get("stage")
    next_stage = saved_stage is not None and saved_stage != args.stage
    weights_only = args.finetune or next_stage
    load_optim = not (args.no_load_optim or weights_only)
    # MTP modules may be added to a checkpoint trained without them (the
    # recipe adds MTP mid-CPT); they keep their fresh initialization.
    allow = ("mtp.",) if weights_only else ()
    meta = checkpointing.load_checkpoint(args.load, trainer.model, trainer.optimizer if load_optim else None,
                                         allow_missing=allow)
    if not weights_only:
        trainer.state.iteration = meta["iteration"]
        trainer.state.consumed_samples = meta["consumed_samples"]
        trainer.state.skipped_iterations = meta.get("skipped_iterations", 0)
    reason = "--finetune" if args.finetune else f"stage {saved_stage} -> {args.stage}"
    log.print(f" loaded checkpoint from {args.load} at iteration {meta['iteration']}"
              + (f" (weights only: {reason})" if weights_only else ""))


def _save(args, trainer: Trainer, log: TrainingLogger) -> None:
    st = trainer.state
    meta = {
        "consumed_samples": st.consumed_samples,
        "skipped_iterations": st.skipped_iterations,
        "stage": args.stage,
        "model_preset": args.model_preset,
        "model_config": asdict(trainer.model_cfg),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
    }
    path = checkpointing.save_checkpoint(args.save, st.iteration, trainer.model, trainer.optimizer, meta)
    log.print(f" saved checkpoint at iteration {st.iteration:8d} to {path}")


def pretrain(argv: Optional[list[str]] = None) -> Trainer:
    args = parse_args(argv)
    env = init_distributed()
    model_cfg = saved_model_config(args) or model_config_from_args(args)
    log = TrainingLogger(env.rank)
    stage = STAGES[args.stage]
    log.print(f"> stage {stage.name}: {stage.description}; preset {args.model_preset}, "
              f"seq-length {args.seq_length}, world size {env.world_size} ({env.launcher}, "
              f"{'cuda' if torch.cuda.is_available() else 'cpu'})")
    train_ds, valid_ds, vocab_size = build_datasets(args, log.print)
    if vocab_size > model_cfg.vocab_size or (args.model_preset == "tiny" and vocab_size != model_cfg.vocab_size):
        model_cfg = model_cfg.replace(vocab_size=vocab_size)
    trainer = build_trainer(args, train_ds, model_cfg)
    counts = count_parameters(model_cfg)
    log.print(f"> model: {counts.total / 1e6:.2f}M parameters, {counts.active / 1e6:.2f}M active, "
              f"{counts.mtp / 1e6:.2f}M MTP; TP={args.tensor_model_parallel_size} "
              f"CP={args.context_parallel_size} EP={args.expert_model_parallel_size} "
              f"DP={trainer.dp_size}; global batch {trainer.global_batch_size}")
    for line in trainer.layout.describe().splitlines()[: None if env.world_size <= 16 else 2]:
        log.print(f"> {line}")
    log = TrainingLogger(
        env.rank,
        tensorboard_dir=args.tensorboard_dir,
        wandb_project=args.wandb_project,
        wandb_name=args.wandb_exp_name,
        wandb_dir=args.wandb_save_dir,
        config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
    )
    _resume(args, trainer, log)
    st = trainer.state
    window = []
    while st.iteration < args.train_iters:
        result = trainer.step()
        window.append(result)
        if st.iteration % args.log_interval == 0 or st.iteration == args.train_iters:
            seconds = sum(r.seconds for r in window)
            tokens = sum(r.tokens for r in window)
            tok_s = tokens / seconds
            tflops = tok_s * trainer.flops_per_token / env.world_size / 1e12
            line = {
                "consumed samples": st.consumed_samples,
                "consumed tokens": st.consumed_samples * args.seq_length,
                "elapsed time per iteration (ms)": 1000.0 * seconds / len(window),
                "learning rate": result.lr,
                "global batch size": trainer.global_batch_size,
                "lm loss": result.lm_loss,
            }
            if model_cfg.mtp_num_layers:
                line["mtp loss"] = result.mtp_loss
            line.update({
                "grad norm": result.grad_norm,
                "number of skipped iterations": st.skipped_iterations,
                "tokens/s": tok_s,
                "throughput per rank (TFLOP/s)": tflops,
            })
            scalars = {"lm-loss": result.lm_loss, "mtp-loss": result.mtp_loss,
                       "learning-rate": result.lr, "grad-norm": result.grad_norm,
                       "tokens-per-sec": tok_s}
            log.log(st.iteration, args.train_iters, line, scalars)
            window = []
        if args.eval_interval and valid_ds is not None and st.iteration % args.eval_interval == 0:
            valid = trainer.evaluate(valid_ds, args.eval_iters)
            log.print(f" validation loss at iteration {st.iteration} | lm loss value: {valid:.6E} |")
            log.scalars(st.iteration, {"validation-lm-loss": valid})
        if args.save and args.save_interval and st.iteration % args.save_interval == 0:
            _save(args, trainer, log)
    if args.save and (not args.save_interval or st.iteration % args.save_interval):
        _save(args, trainer, log)
    if valid_ds is not None:
        valid = trainer.evaluate(valid_ds, args.eval_iters)
        log.print(f" validation loss at the end of training | lm loss value: {valid:.6E} |")
    log.close()
    return trainer
