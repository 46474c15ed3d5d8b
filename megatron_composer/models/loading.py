"""A model built and loaded from a checkpoint, for inference, evaluation and logit checks.

`load_checkpoint_model(path)` finds the checkpoint (`checkpoint.locate_checkpoint`:
a root or an iter_XXXXXXX dir, one converted from Hugging Face included),
builds the GPTModel its meta.json describes and loads it with
`checkpoint.load_checkpoint`, the path training resumes through, so every
reader of a checkpoint sees exactly the weights training would.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..checkpoint import CheckpointError, CheckpointLocation, load_checkpoint, locate_checkpoint
from ..config.model import ModelConfig, model_config_from_dict
from ..parallel.layout import ParallelLayout, initialize_parallel
from ..platform import init_distributed
from .builder import build_model


def checkpoint_model_config(path: str, iteration: Optional[int] = None) -> ModelConfig:
    """The ModelConfig a checkpoint was saved with (its meta.json's `model_config`)."""
    return _saved_config(locate_checkpoint(path, iteration))


def _saved_config(where: CheckpointLocation) -> ModelConfig:
    if "model_config" not in where.meta:
        raise CheckpointError(f"{where.dir}/meta.json has no model_config; it was not written by "
                              "megatron-composer's training or converter")
    return model_config_from_dict(where.meta["model_config"])


def load_checkpoint_model(path: str, seq_length: int, layout: Optional[ParallelLayout] = None,
                          iteration: Optional[int] = None) -> tuple[torch.nn.Module, ModelConfig]:
    """(GPTModel in eval mode, ModelConfig) of a checkpoint, fp32, on this process.

    Initializes torch.distributed (a single process if not launched) and
    megatron-core's parallel state for `layout` (default: every rank a
    data-parallel replica). Raises CheckpointError for a path that holds no
    readable checkpoint.
    """
    where = locate_checkpoint(path, iteration)
    cfg = _saved_config(where)
    env = init_distributed()
    layout = layout or ParallelLayout(world_size=env.world_size)
    initialize_parallel(layout, seed=0)
    model = build_model(cfg, layout, torch.float32, seq_length=seq_length)
    load_checkpoint(where.root, model, iteration=where.iteration)
    model.eval()
    return model, cfg
