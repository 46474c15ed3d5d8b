"""Which parameters of a megatron-core GPTModel (MLA + MoE + MTP) Muon updates, and as what blocks.

Names are megatron-core 0.16.1's (`decoder.layers.{i}.` and MTP's
`mtp.layers.{i}.transformer_layer.` prefixes; rules match name suffixes).

AdamW: embeddings, the output head, every norm weight and bias (anything
with fewer than 2 dims), router weights. Muon: every other matrix. Router
`expert_bias` is a buffer in megatron-core (updated by its aux-loss-free
balancing, not by an optimizer); if it shows up as a parameter without
requires_grad it is left to nobody, like every frozen parameter.

Granularity:
- "matrix": every stored matrix whole, i.e. exactly what torch.optim.Muon
  does with the same parameter list (the Moonlight baseline). Experts are
  separate parameters in megatron-core (SequentialMLP `local_experts.{e}.`,
  TEGroupedMLP `weight{e}`), so this is already per expert.
- "head" (Composer 2.5): additionally split fused matrices into their
  functional parts and attention matrices per head:
    linear_q_up_proj / linear_q_proj [H*(qk+rope), *]: H row blocks; one
        head's nope and rope query rows stay together (one query).
    linear_kv_up_proj [H*(qk+v), kv_lora]: per head a K block [qk, kv_lora]
        and a V block [v, kv_lora]: K and V are different maps (logits vs
        values), fused only for speed, as with a fused QKV.
    linear_proj [hidden, H*v]: H column blocks [hidden, v].
    linear_fc1 (SwiGLU) [2*ffn, hidden]: gate and up, two [ffn, hidden]
        blocks (fused only for speed; gate feeds a nonlinearity, up does not).
  Down-projections stay whole: linear_q_down_proj [q_lora, hidden] and
  linear_kv_down_proj [kv_lora + rope, hidden] compress the hidden state
  for all heads at once (no row or column belongs to one head), and the
  kv_down's last `rope` rows are the key rope shared by all heads, which is
  read together with the latent; so is MTP's eh_proj [hidden, 2*hidden]
  and every linear_fc2.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from megatron_composer.checkpoint.state import expert_global_name
from megatron_composer.optim.muon import Muon, Split
from megatron_composer.optim.sharded_muon import ShardedMuon

GRANULARITIES = ("matrix", "head")


@dataclass(frozen=True)
class HeadGeometry:
    """MLA head sizes as seen by one model replica (per TP rank if TP were used)."""

    num_heads: int
    qk_head_dim: int  # nope part of each query/key head
    qk_pos_emb_head_dim: int  # rope part
    v_head_dim: int

    @classmethod
    def from_config(cls, config) -> "HeadGeometry":
        """From a megatron-core MLATransformerConfig or our config.model.ModelConfig."""
        return cls(config.num_attention_heads, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim)


@dataclass(frozen=True)
class MuonParam:
    name: str
    param: Tensor
    split: Split


_ADAMW_NAMES = re.compile(r"(^|\.)(embedding|output_layer)\.|(^|\.)router\.weight$|expert_bias$")
_LEGACY_GROUPED = re.compile(r"mlp\.experts\.weight[12]$")
_Q_UP = re.compile(r"self_attention\.(linear_q_up_proj|linear_q_proj)\.weight$")
_KV_UP = re.compile(r"self_attention\.linear_kv_up_proj\.weight$")
_O_PROJ = re.compile(r"self_attention\.linear_proj\.weight$")
_FC1 = re.compile(r"linear_fc1\.weight$")


def muon_split(
    name: str,
    shape: Sequence[int],
    geometry: HeadGeometry,
    granularity: str = "head",
    gated_linear_unit: bool = True,
) -> tuple[str, Split]:
    """("adamw", None) or ("muon", split) for one parameter, from its name and shape."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity {granularity!r} is not one of {GRANULARITIES}")
    if len(shape) < 2 or name.endswith("bias") or _ADAMW_NAMES.search(name):
        return "adamw", None
    if _LEGACY_GROUPED.search(name):
        raise ValueError(
            f"{name} {tuple(shape)} is legacy GroupedMLP's flattened expert weight, which Muon cannot split "
            f"per expert; build the MoE with TEGroupedMLP (moe_grouped_gemm + TE) or SequentialMLP"
        )
    if granularity == "matrix":
        return "muon", None
    g = geometry
    if _Q_UP.search(name):
        _expect(name, shape, 0, g.num_heads * (g.qk_head_dim + g.qk_pos_emb_head_dim),
                "num_heads*(qk_head_dim+qk_pos_emb_head_dim)", g)
        return "muon", {"rows": g.num_heads}
    if _KV_UP.search(name):
        _expect(name, shape, 0, g.num_heads * (g.qk_head_dim + g.v_head_dim), "num_heads*(qk_head_dim+v_head_dim)", g)
        if g.qk_head_dim == g.v_head_dim:
            return "muon", {"rows": 2 * g.num_heads}
        return "muon", {"rows": [g.qk_head_dim, g.v_head_dim] * g.num_heads}
    if _O_PROJ.search(name):
        _expect(name, shape, 1, g.num_heads * g.v_head_dim, "num_heads*v_head_dim", g)
        return "muon", {"cols": g.num_heads}
    if gated_linear_unit and _FC1.search(expert_global_name(name)):  # TEGroupedMLP: `weight{e}`
        if shape[0] % 2:
            raise ValueError(f"{name} {tuple(shape)}: a SwiGLU fc1 has an even number of rows (gate; up); "
                             f"pass gated_linear_unit=False for a plain MLP")
        return "muon", {"rows": 2}
    return "muon", None


def _expect(name, shape, dim, want, formula, geometry) -> None:
    if shape[dim] != want:
        raise ValueError(
            f"{name} has shape {tuple(shape)} but {formula} = {want} for {geometry}; pass the "
            f"HeadGeometry of this model (HeadGeometry.from_config) or granularity='matrix'"
        )


def split_muon_adamw(
    named_params: Iterable[tuple[str, Tensor]],
    geometry: HeadGeometry,
    granularity: str = "head",
    gated_linear_unit: bool = True,
) -> tuple[list[MuonParam], list[tuple[str, Tensor]]]:
    """(Muon params with their split, AdamW (name, param) pairs); frozen params go to neither."""
    muon, adamw = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        kind, split = muon_split(name, tuple(p.shape), geometry, granularity, gated_linear_unit)
        if kind == "muon":
            muon.append(MuonParam(name, p, split))
        else:
            adamw.append((name, p))
    return muon, adamw


def muon_param_groups(muon_params: Sequence[MuonParam]) -> list[dict]:
    """One param group per distinct split (Muon's "split" is a group option)."""
    groups: dict = {}
    for mp in muon_params:
        key = repr(sorted((mp.split or {}).items()))
        groups.setdefault(key, {"params": [], "split": mp.split})["params"].append(mp.param)
    return list(groups.values())


def adamw_param_groups(adamw_params: Sequence[tuple[str, Tensor]], weight_decay: float) -> list[dict]:
    """Megatron's default: weight decay on matrices (embedding, head, router), none on norms and biases."""
    decay = [p for n, p in adamw_params if p.ndim >= 2 and not n.endswith("bias")]
    no_decay = [p for n, p in adamw_params if not (p.ndim >= 2 and not n.endswith("bias"))]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def build_muon_adamw(
    model_or_named_params,
    geometry: HeadGeometry,
    *,
    granularity: str = "head",
    gated_linear_unit: bool = True,
    muon_kwargs: Optional[dict] = None,
    adamw_kwargs: Optional[dict] = None,
    shard_layouts: Optional[dict] = None,
) -> tuple[Optional[Muon], Optional[torch.optim.AdamW]]:
    """The two optimizers of a model: (Muon or ShardedMuon, AdamW); None where a side has no params.

    ShardedMuon is chosen when any Muon parameter is a DTensor (FSDP2) or
    shard_layouts is given; otherwise the single-process Muon. Step both
    (and zero_grad both) every iteration; checkpoint both state_dicts.
    """
    named = (model_or_named_params.named_parameters() if isinstance(model_or_named_params, torch.nn.Module)
             else model_or_named_params)
    muon_params, adamw_params = split_muon_adamw(named, geometry, granularity, gated_linear_unit)
    muon_kwargs, adamw_kwargs = dict(muon_kwargs or {}), dict(adamw_kwargs or {})
    muon = None
    if muon_params:
        sharded = shard_layouts or any(hasattr(mp.param, "device_mesh") for mp in muon_params)
        if sharded:
            muon = ShardedMuon(muon_param_groups(muon_params), shard_layouts=shard_layouts, **muon_kwargs)
        else:
            muon = Muon(muon_param_groups(muon_params), **muon_kwargs)
    adamw = None
    if adamw_params:
        weight_decay = adamw_kwargs.pop("weight_decay", 0.01)
        adamw = torch.optim.AdamW(adamw_param_groups(adamw_params, weight_decay), **adamw_kwargs)
    return muon, adamw
