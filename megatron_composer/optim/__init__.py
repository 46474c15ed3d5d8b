"""Optimizers: Muon (per matrix / head / expert, single-process and sharded) beside AdamW.

Training loop (after fully_shard, if any; Muon or ShardedMuon is picked from the params):
    muon, adamw = build_muon_adamw(model, HeadGeometry.from_config(cfg),
                                   muon_kwargs=dict(lr=0.02, adjust_lr_fn="match_rms_adamw"),
                                   adamw_kwargs=dict(lr=3e-4, weight_decay=0.1))
    ... loss.backward(); muon.step(); adamw.step(); muon.zero_grad(); adamw.zero_grad()
Checkpoint: plain `opt.state_dict()` / `load_state_dict` (weights_only-safe);
with FSDP2 `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(
model, opt)` / `set_optimizer_state_dict(model, opt, sd)` for each optimizer.
"""
from megatron_composer.optim.muon import (
    DEFAULT_NS_COEFFICIENTS,
    Muon,
    NewtonSchulzConfig,
    adjusted_lr,
    matrix_blocks,
    momentum_update,
    newton_schulz,
    orthogonalize_local,
)
from megatron_composer.optim.param_groups import (
    HeadGeometry,
    MuonParam,
    build_muon_adamw,
    muon_param_groups,
    muon_split,
    split_muon_adamw,
)
from megatron_composer.optim.sharded_muon import ShardedMuon, ShardLayout, chunk_range, sharded_orthogonalize

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "HeadGeometry",
    "Muon",
    "MuonParam",
    "NewtonSchulzConfig",
    "ShardLayout",
    "ShardedMuon",
    "adjusted_lr",
    "build_muon_adamw",
    "chunk_range",
    "matrix_blocks",
    "momentum_update",
    "muon_param_groups",
    "muon_split",
    "newton_schulz",
    "orthogonalize_local",
    "sharded_orthogonalize",
    "split_muon_adamw",
]
