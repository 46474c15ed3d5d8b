"""The training loop's optimizer for `--optimizer muon`: Muon + AdamW as one.

Muon (or ShardedMuon under FSDP2) takes the 2-D hidden weights at the
granularity of `--muon-granularity`; AdamW takes embeddings, the output head,
router weights, norms and biases. `MuonWithAdamW` presents both as one
`torch.optim.Optimizer`-like object (param_groups, state, step, zero_grad),
so the loop's LR schedule, gradient clipping and checkpointing (which key
optimizer state by parameter name) treat it like AdamW. With
`adjust_lr_fn="match_rms_adamw"` (the default) Muon's update RMS matches
AdamW's, so both follow the same learning-rate schedule.
"""
from __future__ import annotations

import torch

from ..models.forward import unwrap
from .param_groups import HeadGeometry, build_muon_adamw


class MuonWithAdamW:
    def __init__(self, muon, adamw):
        self.optimizers = [o for o in (muon, adamw) if o is not None]
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        # A plain merged dict: the optimizers' states are defaultdicts, so a
        # ChainMap lookup would invent an empty entry in the first one.
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, states):
        for o, s in zip(self.optimizers, states):
            o.load_state_dict(s)


def build_muon_optimizer(model, *, lr: float, weight_decay: float = 0.1, momentum: float = 0.95,
                         nesterov: bool = True, ns_steps: int = 5,
                         adjust_lr_fn: str = "match_rms_adamw", granularity: str = "head",
                         betas=(0.9, 0.95), eps: float = 1e-8) -> MuonWithAdamW:
    """Muon + AdamW for `model` (call after any FSDP2 sharding)."""
    gpt = unwrap(model)
    muon, adamw = build_muon_adamw(
        [(n, p) for n, p in gpt.named_parameters() if p.requires_grad],
        HeadGeometry.from_config(gpt.config),
        granularity=granularity,
        muon_kwargs=dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn),
        adamw_kwargs=dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps),
    )
    return MuonWithAdamW(muon, adamw)
