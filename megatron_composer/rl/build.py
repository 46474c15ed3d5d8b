"""The RL trainer of a parsed `train_rl.py` command line, on this process's rank.

Both drivers build it here: the synchronous loop in the launching process
(torchrun ranks) and each asynchronous trainer actor inside its own process
group, from the same `RLRunConfig`.
"""
from __future__ import annotations

from ..checkpoint import checkpoint_tokenizer
from ..config import count_parameters
from ..data import default_cpt_data
from ..data.tokenizer import Tokenizer
from ..parallel import ParallelLayout
from ..platform import init_distributed
from ..training.arguments import resolve_model_config
from ..training.checkpointer import check_paths, moved_message
from .arguments import RLRunConfig
from .trainer import RLTrainer


def build_rl_trainer(run: RLRunConfig, *, log=None) -> RLTrainer:
    """The `RLTrainer` of `run` on this rank's process group (logging to `run.logging` unless `log`)."""
    env = init_distributed(timeout_minutes=run.distributed_timeout_minutes)
    ckpt = run.training.checkpoint
    moved = check_paths(ckpt.load, ckpt.save, ckpt.overwrite_save)
    tokenizer = Tokenizer(tokenizer_model(run))
    model_cfg = resolve_model_config(run.model, tokenizer.vocab_size)
    layout = ParallelLayout.from_sizes(env.world_size, run.parallel, model_cfg.num_experts or None)
    log = log or run.logging.logger(env.rank)
    if moved:
        log.print(moved_message(ckpt.save, moved))
    trainer = RLTrainer(model_cfg, layout, run.training, run.rl, tokenizer, log=log)
    rl, counts = run.rl, count_parameters(model_cfg)
    log.print(f"> {trainer.env.describe()}, {rl.rollout.prompts_per_step} x {rl.rollout.group_size} samples per step, "
              f"{rl.rollout.max_new_tokens} new tokens, advantage {rl.algorithm.advantage}, policy loss {rl.algorithm.policy_loss}"
              f"{f' in {rl.algorithm.ppo_mini_batches} mini-batches' if rl.algorithm.ppo_mini_batches > 1 else ''}, "
              f"kl {rl.algorithm.kl_coef} ({rl.algorithm.kl_kind} in the {rl.algorithm.kl_placement}), router replay "
              f"{'on' if trainer.replay is not None else 'off'}; model {counts.total / 1e6:.2f}M parameters, "
              f"DP={trainer.dp_size} CP={layout.cp}")
    return trainer


def tokenizer_model(run: RLRunConfig) -> str:
    """--tokenizer-model, else the one saved in --load's checkpoint, else the embedded corpus's."""
    if run.tokenizer_model:
        return run.tokenizer_model
    load = run.training.checkpoint.load
    saved = checkpoint_tokenizer(load) if load else None
    if saved:
        return saved
    return default_cpt_data(run.data_cache_dir, progress=False).tokenizer_model
