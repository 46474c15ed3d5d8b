"""Global sequence packing for an RL step: equal compute per data-parallel rank.

RL lengths are long-tailed (a few rollouts run to the generation limit while
most stop early), so dealing sequences out round-robin, or in arrival order,
leaves every rank waiting for the one that drew the long tail. Before every
step the loop plans the whole batch at once:

1. cost of a sequence of L tokens: cost(L) = linear_cost * L + quadratic_cost * L^2
   (`attention_costs` derives both from the model shape);
2. `pack_balanced` splits the sequences over the DP ranks, minimizing the
   largest rank cost: longest-processing-time first (LPT), then exchanges of
   up to two sequences each way between the heaviest rank and lighter ones
   while they lower the heaviest rank's cost;
3. `pack_micro_batches` packs each rank's sequences into micro-batches under
   a token budget (first-fit decreasing); `plan_step` does 2 and 3.

Everything is deterministic: ties are broken by sequence and bin index, so
every rank computes the same plan from the same lengths without communicating.
"""
from __future__ import annotations

import functools
import heapq
import math
from typing import Sequence

import numpy as np

from ..config.model import ModelConfig, training_flops_per_token

# A refinement step must lower the heaviest bin by more than this fraction of
# the gap it closes; it keeps float rounding from cycling.
_MIN_RELATIVE_GAIN = 1e-12
# Exchanges move pairs of sequences too while a bin holds at most this many.
_PAIRS_UP_TO = 64
# Refinement stops once the heaviest bin is within this fraction of the lower
# bound max(largest sequence, mean bin cost); the FLOP model is coarser than that.
_CLOSE_ENOUGH = 1e-4


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out = []
    for i, length in enumerate(lengths):
        if not (length >= 0 and int(length) == length):
            raise ValueError(f"sequence {i} has length {length}; lengths must be integers >= 0")
        out.append(int(length))
    return out


def sequence_costs(lengths: Sequence[int], linear_cost: float = 1.0, quadratic_cost: float = 0.0) -> list[float]:
    """cost_i = linear_cost * L_i + quadratic_cost * L_i^2 for every length L_i."""
    for name, c in (("linear_cost", linear_cost), ("quadratic_cost", quadratic_cost)):
        if not (isinstance(c, (int, float)) and 0 <= c < math.inf):
            raise ValueError(f"{name} {c!r} must be a finite number >= 0")
    return [linear_cost * L + quadratic_cost * L * L for L in _check_lengths(lengths)]


def _lpt(costs: list[float], num_bins: int) -> tuple[list[list[int]], list[float]]:
    """Longest processing time first: each sequence, largest cost first, goes to the lightest bin.

    Ties: equal costs in index order; equal bin loads go to the bin with fewer
    sequences, then the lower bin index (so zero-cost sequences still spread out).
    """
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0.0] * num_bins
    heap = [(0.0, 0, b) for b in range(num_bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, count, b = heapq.heappop(heap)
        bins[b].append(i)
        loads[b] = load + costs[i]
        heapq.heappush(heap, (loads[b], count + 1, b))
    return bins, loads


@functools.lru_cache(maxsize=None)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, 1) if n <= _PAIRS_UP_TO else (np.zeros(0, np.int64), np.zeros(0, np.int64))


def _subset_costs(items: list[int], costs: np.ndarray) -> np.ndarray:
    """Costs of the subsets of a bin that may be exchanged: [empty, each sequence, each pair].

    Pairs only while the bin holds at most _PAIRS_UP_TO sequences (with more,
    single moves and swaps leave little to gain).
    """
    c = costs[items] if items else np.zeros(0)
    first, second = _pairs(len(items))
    return np.concatenate(([0.0], c, c[first] + c[second]))


def _subset_positions(n: int, k: int) -> tuple[int, ...]:
    """Positions in the bin of subset k of `_subset_costs`."""
    if k == 0:
        return ()
    if k <= n:
        return (k - 1,)
    first, second = _pairs(n)
    return int(first[k - 1 - n]), int(second[k - 1 - n])


def _best_exchange(heavy: list[int], light: list[int], costs: np.ndarray, gap: float):
    """The exchange between two bins that lowers the heavier one most, keeping the lighter below it.

    Exchanging a set S of the heavy bin's sequences for a set R of the light
    one's (d = cost(S) - cost(R); a move is R empty, a swap |S| = |R| = 1)
    turns loads (H, H - gap) into (H - d, H - gap + d); the larger is
    H - min(d, gap - d), so the best exchange has d closest to gap / 2 within
    (0, gap). For each S, the two R nearest cost(S) - gap / 2 are found by
    binary search. Returns (positions in heavy, positions in light) or None.
    """
    out_costs = _subset_costs(heavy, costs)
    back_costs = _subset_costs(light, costs)
    order = np.argsort(back_costs, kind="stable")
    sorted_back = back_costs[order]
    nearest = np.searchsorted(sorted_back, out_costs - gap / 2)
    candidates = np.stack([np.clip(nearest - 1, 0, None), np.clip(nearest, None, sorted_back.size - 1)], axis=1)
    d = out_costs[:, None] - sorted_back[candidates]
    gain = np.minimum(d, gap - d)
    flat = int(np.argmax(gain))  # first maximum: deterministic
    s, j = divmod(flat, 2)
    if gain[s, j] <= _MIN_RELATIVE_GAIN * gap:
        return None
    return _subset_positions(len(heavy), s), _subset_positions(len(light), int(order[candidates[s, j]]))


def _refine(bins: list[list[int]], loads: list[float], costs: np.ndarray, max_rounds: int) -> None:
    """Lower the heaviest bin by exchanges with the lightest bin that allows one, until none does
    or it is within _CLOSE_ENOUGH of the lower bound."""
    num_bins = len(bins)
    lower_bound = max(float(costs.max(initial=0.0)), sum(loads) / num_bins)
    for _ in range(max_rounds):
        heavy = max(range(num_bins), key=lambda b: (loads[b], -b))
        if loads[heavy] <= lower_bound * (1 + _CLOSE_ENOUGH):
            return
        for light in sorted(range(num_bins), key=lambda b: (loads[b], b)):
            gap = loads[heavy] - loads[light]
            if gap <= 0:
                return
            step = _best_exchange(bins[heavy], bins[light], costs, gap)
            if step is None:
                continue
            out = [bins[heavy][p] for p in step[0]]
            back = [bins[light][p] for p in step[1]]
            bins[heavy] = [i for i in bins[heavy] if i not in out] + back
            bins[light] = [i for i in bins[light] if i not in back] + out
            delta = float(costs[out].sum() - costs[back].sum()) if back else float(costs[out].sum())
            loads[heavy] -= delta
            loads[light] += delta
            break
        else:
            return


def pack_balanced(lengths: Sequence[int], num_bins: int, *, linear_cost: float = 1.0,
                  quadratic_cost: float = 0.0) -> list[list[int]]:
    """Split sequences into `num_bins` bins minimizing the largest bin cost.

    Bin cost = sum of cost(L) = linear_cost * L + quadratic_cost * L^2 over its
    sequences. LPT (within 4/3 of the optimum), then refinement by exchanges
    of up to two sequences each way between the heaviest bin and lighter ones,
    until none helps or the heaviest bin is within 1e-4 of the lower bound
    max(largest sequence cost, mean bin cost).

    lengths: token counts, one per sequence. Returns, for each bin, the sorted
    indices of its sequences; every index appears exactly once (bins may be
    empty when there are fewer sequences than bins).
    """
    if not (isinstance(num_bins, int) and num_bins >= 1):
        raise ValueError(f"num_bins {num_bins!r} must be an integer >= 1")
    costs = sequence_costs(lengths, linear_cost, quadratic_cost)
    bins, loads = _lpt(costs, num_bins)
    if num_bins > 1:
        _refine(bins, loads, np.asarray(costs, dtype=np.float64), max_rounds=4 * len(costs) + num_bins)
    return [sorted(b) for b in bins]


def pack_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: micro-batches of sequence indices, each with at most `token_budget` tokens.

    Sequences are placed longest first (ties by index) into the first
    micro-batch with room, else a new one. Returns the micro-batches in
    creation order, each with its indices sorted.
    """
    if not (isinstance(token_budget, int) and token_budget >= 1):
        raise ValueError(f"token_budget {token_budget!r} must be an integer >= 1")
    lengths = _check_lengths(lengths)
    batches: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > token_budget:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than the micro-batch token budget "
                             f"{token_budget}; raise the budget to at least {lengths[i]} or cap the generation length")
        for b, u in enumerate(used):
            if u + lengths[i] <= token_budget:
                batches[b].append(i)
                used[b] += lengths[i]
                break
        else:
            batches.append([i])
            used.append(lengths[i])
    return [sorted(b) for b in batches]


def attention_costs(model_config: ModelConfig) -> tuple[float, float]:
    """(linear_cost, quadratic_cost) of one training sequence, in FLOPs (forward + backward).

    From `training_flops_per_token` (causal attention over an average context
    of L / 2), a sequence of L tokens costs L * f(L) with
    f(L) = 3 * (2 * W + 2 * heads * (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) * L / 2 * layers):

        linear_cost    = f(0) = 3 * 2 * W     (W: active matmul weights per token, dense and MoE)
        quadratic_cost = f(1) - f(0) = 3 * heads * (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) * layers

    i.e. 2 * heads * (qk + v) FLOPs per (query, key) pair, L^2 / 2 causal pairs,
    per layer (MTP layers included). Packed sequences attend only within
    themselves, so a bin's cost is the sum of its sequences' costs.
    """
    linear = training_flops_per_token(model_config, 0)
    return linear, training_flops_per_token(model_config, 1) - linear


def plan_step(lengths: Sequence[int], dp_size: int, token_budget: int, linear_cost: float = 1.0,
              quadratic_cost: float = 0.0) -> list[list[list[int]]]:
    """plan[rank][micro_batch] = sequence indices: cost-balanced over DP ranks, then micro-batches.

    Ranks may get different numbers of micro-batches (each rank's count is
    what its share needs); the loop accumulates gradients over its own ones.
    """
    ranks = pack_balanced(lengths, dp_size, linear_cost=linear_cost, quadratic_cost=quadratic_cost)
    lengths = _check_lengths(lengths)
    return [[[rank[j] for j in mb] for mb in pack_micro_batches([lengths[i] for i in rank], token_budget)]
            for rank in ranks]
