"""`pretrain_cpt.py --eval-base-interval N`: the base evals on the model being trained.

The inputs are prepared once at start-up (`suite.BaseEvals`); each call
wraps the trainer's model in an `EvalModel` (the inference engine's forward:
every rank must hold whole weights, so DDP with TP = EP = 1 and the local
layer spec, any DP and CP; `training.arguments` refuses the rest) and every
rank scores its share. Evaluating runs under no_grad in eval mode, so the
training trajectory is the one without evals.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .lm import EvalModel
from .sources import directory_source, held_out_source
from .suite import BaseEvals, EvalConfig, parse_evals, scalars


class BaseEvalHook:
    """Called as `hook(model, model_config)` -> the logged scalars (`suite.SCALARS` names)."""

    def __init__(self, tokenizer, window: int, cfg: EvalConfig, data: Optional[str] = None):
        source = directory_source(data) if data else held_out_source()
        self.evals = BaseEvals(source, tokenizer, window, cfg)
        self.tokenizer, self.window = tokenizer, window
        self.last: dict = {}

    @classmethod
    def from_args(cls, args, tokenizer, model_cfg) -> "BaseEvalHook":
        # seed 0 whatever --seed: the same tasks as tools/eval_base.py's defaults, comparable across runs
        cfg = EvalConfig.bounded(args.eval_base_samples, evals=parse_evals(args.eval_base_evals))
        return cls(tokenizer, min(args.seq_length, model_cfg.max_position_embeddings), cfg, args.eval_base_data)

    def __call__(self, model, model_config) -> dict[str, float]:
        lm = EvalModel(model, model_config, self.tokenizer, self.window)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.last = self.evals.run(lm, rank, world)
        return scalars(self.last)
