"""`train_rl.py`'s body: parse, build, train."""
from __future__ import annotations

from typing import Optional

from ..config import count_parameters
from ..data import default_cpt_data
from ..data.tokenizer import Tokenizer
from ..parallel import ParallelLayout
from ..platform import init_distributed
from ..training.arguments import model_config_from_args
from ..training.checkpointer import check_paths
from ..training.logger import TrainingLogger
from ..training.pretrain import saved_model_config
from .arguments import parse_rl_args
from .trainer import RLTrainer


def train_rl(argv: Optional[list[str]] = None):
    """Synchronous RL in this process (torchrun for more ranks), or with --async-rl the Ray services."""
    args, _, _ = parse_rl_args(argv)
    if args.async_rl:
        from .async_rl.runner import run_async_rl

        return run_async_rl(argv)
    args, rl, trainer, log = build_rl_trainer(argv)
    try:
        trainer.resume()
        trainer.train()
    finally:
        log.close()
    return trainer


def build_rl_trainer(argv: Optional[list[str]] = None):
    """(args, RLConfig, RLTrainer, its logger) from train_rl.py's flags, on this rank's process group."""
    args, cfg, rl = parse_rl_args(argv)
    env = init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    check_paths(args.load, args.save)
    tokenizer_model = args.tokenizer_model or default_cpt_data(args.data_cache_dir, progress=False).tokenizer_model
    tokenizer = Tokenizer(tokenizer_model)
    model_cfg = saved_model_config(args) or model_config_from_args(args)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        model_cfg = model_cfg.replace(vocab_size=tokenizer.vocab_size)
    layout = ParallelLayout.from_sizes(env.world_size, args, model_cfg.num_experts or None)
    log = TrainingLogger(env.rank, tensorboard_dir=args.tensorboard_dir, wandb_project=args.wandb_project,
                         wandb_name=args.wandb_exp_name, wandb_dir=args.wandb_save_dir)
    trainer = RLTrainer(model_cfg, layout, cfg, rl, tokenizer, log=log)
    counts = count_parameters(model_cfg)
    what = (f"RL task {rl.task}: {len(trainer.prompts)} prompts" if trainer.env is None else
            f"RL env {rl.env} ({rl.task_families}): {len(trainer.prompts)} tasks, up to {rl.max_turns} turns of "
            f"{rl.max_new_tokens} tokens, summaries at {rl.summary_trigger_tokens or 'never'}")
    log.print(f"> {what}, {rl.prompts_per_step} x {rl.group_size} "
              f"samples per step, {rl.max_new_tokens} new tokens, advantage {rl.advantage}, "
              f"kl {rl.kl_coef} ({rl.kl_kind} in the {rl.kl_placement}), router replay "
              f"{'on' if trainer.replay is not None else 'off'}; model {counts.total / 1e6:.2f}M parameters, "
              f"DP={trainer.dp_size} CP={layout.cp}")
    return args, rl, trainer, log
