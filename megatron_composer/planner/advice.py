"""Which knob to turn when a layout does not fit: re-plan with each one turned.

Each candidate changes one flag of the setup (a valid value only: layouts
that would not run are skipped) and is judged by the memory plan alone,
`planned_total(setup) -> bytes per GPU`, which `plan.make_plan` hands in (so
this module needs nothing from `plan.py`, which calls it). The
answer lists the candidates that fit, else the ones that save most, and a
combination found greedily (the best single knob, then the best next one,
up to six) when no single knob is enough.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from ..config.training import RecomputeConfig

GiB = 1 << 30
FULL = RecomputeConfig("full", "uniform", 1)


def _candidates(s) -> list[tuple[str, Callable]]:
    """(flag text, setup -> changed setup or None) for every knob."""
    world = s.world_size

    def recompute_full(x):
        return None if x.recompute == FULL else x.replace(recompute=FULL)

    def selective(x):
        r = RecomputeConfig("selective", recompute_modules=("moe", "mla_up_proj"))
        return None if x.recompute.recompute_granularity else x.replace(recompute=r)

    def micro_batch(x):
        if x.micro_batch_size == 1:
            return None
        return x.replace(micro_batch_size=1, global_batch_size=x.global_batch)

    def more_cp(x):
        shard = x.dense_shard_size and math.lcm(x.dense_shard_size, 2 * x.cp)
        return x.replace(cp=2 * x.cp, dense_shard_size=shard)

    def wider_shard(x):
        if x.data_parallel_sharding != "hsdp" or x.shard * 2 > world:
            return None
        return x.replace(dense_shard_size=2 * x.shard)

    def more_ep(x):
        return x.replace(ep=2 * x.ep)

    def muon(x):
        return None if x.optimizer == "muon" else x.replace(optimizer="muon")

    def hsdp(x):
        return None if x.data_parallel_sharding == "hsdp" else x.replace(data_parallel_sharding="hsdp")

    def te_experts(x):
        if x.transformer_impl != "local" or not x.model.num_moe_layers:
            return None
        return x.replace(transformer_impl="transformer_engine")

    def more_nodes(x):
        return x.replace(nodes=2 * x.nodes)

    return [
        ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", recompute_full),
        ("--recompute-granularity selective --recompute-modules moe mla_up_proj", selective),
        ("--micro-batch-size 1", micro_batch),
        ("--cp {cp} (dense shard size {shard})", more_cp),
        ("--dense-shard-size {shard}", wider_shard),
        ("--ep {ep}", more_ep),
        ("--optimizer muon", muon),
        ("--data-parallel-sharding hsdp", hsdp),
        ("--transformer-impl transformer_engine (no stacked expert weights)", te_experts),
        ("--nodes {nodes}", more_nodes),
    ]


PlannedTotal = Callable[[object], int]  # setup -> planned bytes per GPU; ValueError if it cannot run


def _try(s, change, planned_total: PlannedTotal) -> Optional[tuple[object, int]]:
    new = change(s)
    if new is None:
        return None
    try:
        return new, planned_total(new)
    except ValueError:
        return None


def _label(text: str, s) -> str:
    return text.format(cp=s.cp, shard=s.shard, ep=s.ep, nodes=s.nodes)


def advise(s, total: int, planned_total: PlannedTotal) -> list[str]:
    """Lines naming the knobs that make `s` fit (or help most), given its planned `total` bytes
    and the memory plan that judges each changed setup."""
    capacity = s.capacity
    tried = []
    for text, change in _candidates(s):
        got = _try(s, change, planned_total)
        if got is not None:
            new, new_total = got
            tried.append((new_total, _label(text, new), new))
    tried.sort(key=lambda t: t[0])
    fitting = [t for t in tried if t[0] <= capacity]
    lines = [f"does not fit: needs {total / GiB:.1f} GiB of {capacity / GiB:.1f} GiB per GPU"]
    shown = fitting or [t for t in tried if t[0] < total][:4]
    for new_total, label, _ in shown:
        verdict = "fits" if new_total <= capacity else "still over"
        lines.append(f"  {label}: {new_total / GiB:.1f} GiB ({verdict}, saves {(total - new_total) / GiB:.1f} GiB)")
    if not fitting and tried:
        lines.extend(_combination(s, capacity, planned_total))
    return lines


def _combination(s, capacity: int, planned_total: PlannedTotal) -> list[str]:
    """Greedy: turn the knob that saves most, then the next, up to six times (a knob turned
    twice is shown once, at its last value)."""
    chosen: dict[str, str] = {}
    current, total = s, None
    for _ in range(6):
        best = None
        for text, change in _candidates(current):
            got = _try(current, change, planned_total)
            if got is not None and (best is None or got[1] < best[1]):
                best = (got[0], got[1], text)
        if best is None or (total is not None and best[1] >= total):
            break
        current, total = best[0], best[1]
        chosen[best[2]] = _label(best[2], current)
        if total <= capacity:
            return [f"  together: {' and '.join(chosen.values())}: {total / GiB:.1f} GiB (fits)"]
    if chosen:
        return [f"  together: {' and '.join(chosen.values())}: {total / GiB:.1f} GiB (still over; "
                f"more nodes or GPUs with more memory are needed)"]
    return []
