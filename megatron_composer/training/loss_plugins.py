"""Loss plug-ins of the training step, chosen once when the Trainer is built.

A plug-in turns one micro-batch and the model's outputs into a *sum* over
the positions it trains, and says how many positions that is (`count`). The
step adds up the counts of the whole global batch first (one all-reduce over
DP x CP) and minimizes `sum_i scale_i * sum_i / count_i`, so every plug-in is
a per-position mean over the global batch, exact under any split into
micro-batches and data-parallel or context-parallel ranks. A new objective
(the RL policy loss, a distillation term) is one more plug-in; the step
does not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config.model import ModelConfig
from ..config.training import TrainingConfig
from .batches import Batch
from .losses import Shift, lm_loss, mtp_cross_entropy_loss, mtp_self_distillation_loss, mtp_valid_mask


@dataclass
class ModelOutput:
    """What one forward returns: main logits [b, s, v] and one [b, s, v] per MTP depth.

    The plug-ins' losses write their gradients into these tensors' own storage
    (`overwrite_logits`: the MTP heads' during the MTP loss's forward, the main
    head's during backward), so nothing may read them after the MTP loss's
    `loss_sum` except through autograd. That is what keeps the losses' extra
    memory at a few chunks of positions instead of one logits-sized gradient each.
    """

    logits: torch.Tensor
    mtp_logits: list


class LossPlugin(Protocol):
    name: str  # the log key, e.g. "lm loss"
    scale: float

    def count(self, batch: Batch, shift: Shift) -> torch.Tensor:
        """Number of positions this micro-batch contributes (a scalar tensor)."""

    def loss_sum(self, batch: Batch, out: ModelOutput, shift: Shift) -> torch.Tensor:
        """Sum of the per-position losses of this micro-batch (a scalar tensor)."""


@dataclass
class LMLoss:
    """Next-token cross-entropy on the loss-masked tokens; `fusion`: through
    megatron-core's fused cross-entropy (--cross-entropy-loss-fusion)."""

    name: str = "lm loss"
    scale: float = 1.0
    fusion: bool = False

    def count(self, batch, shift):
        return batch.loss_mask.sum()

    def loss_sum(self, batch, out, shift):
        return lm_loss(out.logits, batch.labels, batch.loss_mask, fusion=self.fusion, overwrite_logits=True)[0]


@dataclass
class MTPLoss:
    """The MTP heads' loss summed over depths: self-distillation toward the main
    head (Composer) or cross-entropy on the token `depth` further (DeepSeek-V3).
    The teacher is read during this forward, before the LM loss's backward
    writes its gradient over the main logits."""

    depth: int
    kind: str = "self-distill"
    scale: float = 0.1
    name: str = "mtp loss"
    fusion: bool = False  # for kind "ce"

    def count(self, batch, shift):
        return sum(mtp_valid_mask(batch.loss_mask, k, batch.segment_ids, shift).sum()
                   for k in range(1, self.depth + 1))

    def loss_sum(self, batch, out, shift):
        total = torch.zeros((), device=out.logits.device)
        for depth, head in enumerate(out.mtp_logits, start=1):
            if self.kind == "self-distill":
                s, _ = mtp_self_distillation_loss(head, out.logits, batch.loss_mask, depth,
                                                  batch.segment_ids, shift, overwrite_logits=True)
            else:
                s, _ = mtp_cross_entropy_loss(head, batch.labels, batch.loss_mask, depth, batch.segment_ids,
                                              shift, fusion=self.fusion, overwrite_logits=True)
            total = total + s
        return total


def build_loss_plugins(model_cfg: ModelConfig, cfg: TrainingConfig) -> list:
    """LM loss, plus the MTP loss when the model has MTP layers."""
    fusion = cfg.cross_entropy_loss_fusion
    plugins = [LMLoss(fusion=fusion)]
    if model_cfg.mtp_num_layers:
        plugins.append(MTPLoss(model_cfg.mtp_num_layers, cfg.mtp_loss, cfg.mtp_loss_scaling_factor, fusion=fusion))
    return plugins
