"""`pretrain_cpt.py`'s body: parse, build, train."""
from __future__ import annotations

from typing import Optional

import torch

from ..config import TrainingConfig, count_parameters, get_stage
from ..parallel import ParallelLayout
from ..platform import init_distributed
from .checkpointer import check_paths, moved_message
from .arguments import ModelSource, parse_args, resolve_model_config
from .data import build_datasets, stage_data
from .logger import TrainingLogger
from .trainer import Trainer, TrainingData


def _scalar_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}


def pretrain(argv: Optional[list[str]] = None) -> Trainer:
    args = parse_args(argv)
    cfg = TrainingConfig.from_args(args)
    env = init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    log = TrainingLogger(env.rank)
    moved = check_paths(args.load, args.save, args.overwrite_save)  # before hours of data and model building
    if moved:
        log.print(moved_message(args.save, moved))
    stage = get_stage(args.stage)
    log.print(f"> stage {stage.name}: {stage.description}; preset {args.model_preset}, "
              f"seq-length {args.seq_length}, world size {env.world_size} ({env.launcher}, "
              f"{'cuda' if torch.cuda.is_available() else 'cpu'})")
    data = stage_data(args, log.print)
    cfg = cfg.with_tokenizer(data.tokenizer.model_path)  # checkpoints carry their tokenizer
    model_cfg = resolve_model_config(ModelSource.from_args(args), data.tokenizer.vocab_size)
    train, valid = build_datasets(data, args, model_cfg.vocab_size)
    log.print(f"> data: {len(train)} training samples of {args.seq_length} tokens"
              + (f", {len(valid)} validation samples" if valid is not None else ""))
    layout = ParallelLayout.from_sizes(env.world_size, args, model_cfg.num_experts or None)
    log = TrainingLogger(env.rank, tensorboard_dir=args.tensorboard_dir, wandb_project=args.wandb_project,
                         wandb_name=args.wandb_exp_name, wandb_dir=args.wandb_save_dir,
                         config=_scalar_args(args))
    base_eval = None
    if cfg.eval_base_interval:
        from ..eval.hook import BaseEvalHook

        base_eval = BaseEvalHook.from_args(args, data.tokenizer, model_cfg)
        log.print(f"> base evals every {cfg.eval_base_interval} iterations: {args.eval_base_evals} "
                  f"on {base_eval.evals.source.name}, at most {args.eval_base_samples} items each")
    trainer = Trainer(model_cfg, layout, TrainingData(train, valid), cfg, log=log, base_eval=base_eval)
    counts = count_parameters(model_cfg)
    log.print(f"> model: {counts.total / 1e6:.2f}M parameters, {counts.active / 1e6:.2f}M active, "
              f"{counts.mtp / 1e6:.2f}M MTP; TP={layout.tp} CP={layout.cp} EP={layout.ep} "
              f"DP={trainer.dp_size}; global batch {trainer.global_batch_size}; "
              f"{'bf16 compute, fp32 main weights' if cfg.bf16 else 'fp32'}")
    for line in layout.describe().splitlines()[: None if env.world_size <= 16 else 2]:
        log.print(f"> {line}")
    try:
        trainer.resume()
        trainer.train()
    finally:
        log.close()
    return trainer
