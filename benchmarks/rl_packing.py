"""Balance of the RL packing stage: max/mean bin cost for ours vs round-robin vs sorted greedy.

    python benchmarks/rl_packing.py [--per-bin 16] [--bins 8 64 512] [--seed 0]

Lengths are long-tailed, as RL rollouts are, and capped at a 32K generation
limit: log-normal (median 2K tokens, sigma 1) and Pareto (256 * (1 + Pareto(1.2))).
Each setting draws `--per-bin` sequences per bin (fixed seed) and splits them
three ways:

  round-robin    sequence i to bin i mod bins (arrival order)
  sorted greedy  LPT: longest first, each to the lightest bin (no refinement)
  ours           `pack_balanced`: LPT, then exchanges between the heaviest bin and lighter ones

Costs are cost(L) = L ("linear"), or linear + quadratic from
`attention_costs` of the deepseek-v3 preset ("attention": 2 * W FLOPs per
token and 2 * heads * (qk + v) per causal token pair; they are equal at
L ~ 29K). Imbalance is max bin cost / mean bin cost; `bound` is the best any
split can do, max(largest sequence, mean) / mean. Target for ours: <= 1.05
wherever the bound allows it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_composer.config import get_preset  # noqa: E402
from megatron_composer.rl.packing import _lpt, attention_costs, pack_balanced, sequence_costs  # noqa: E402

MAX_LENGTH = 32768


def rl_lengths(kind: str, n: int, rng: np.random.Generator) -> list[int]:
    if kind == "lognormal":
        raw = rng.lognormal(np.log(2000), 1.0, n)
    else:
        raw = 256 * (1 + rng.pareto(1.2, n))
    return np.clip(raw, 16, MAX_LENGTH).astype(int).tolist()


def imbalance(bins: list[list[int]], costs: list[float]) -> float:
    loads = [sum(costs[i] for i in b) for b in bins]
    return max(loads) / (sum(loads) / len(loads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-bin", type=int, default=16)
    parser.add_argument("--bins", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    linear, quadratic = attention_costs(get_preset("deepseek-v3"))
    cost_models = {"linear": (1.0, 0.0), "attention": (1.0, quadratic / linear)}
    print(f"{'lengths':9} {'cost':9} {'bins':>4} {'seqs':>5} {'round-robin':>11} {'greedy':>7} "
          f"{'ours':>7} {'bound':>7} {'ours ms':>8}")
    for kind in ("lognormal", "pareto"):
        for num_bins in args.bins:
            rng = np.random.default_rng([args.seed, num_bins, kind == "pareto"])
            lengths = rl_lengths(kind, args.per_bin * num_bins, rng)
            for cost_name, (lin, quad) in cost_models.items():
                costs = sequence_costs(lengths, lin, quad)
                round_robin = [list(range(b, len(lengths), num_bins)) for b in range(num_bins)]
                greedy, _ = _lpt(costs, num_bins)
                start = time.perf_counter()
                ours = pack_balanced(lengths, num_bins, linear_cost=lin, quadratic_cost=quad)
                ms = 1e3 * (time.perf_counter() - start)
                mean = sum(costs) / num_bins
                bound = max(max(costs), mean) / mean
                print(f"{kind:9} {cost_name:9} {num_bins:4d} {len(lengths):5d} {imbalance(round_robin, costs):11.3f} "
                      f"{imbalance(greedy, costs):7.3f} {imbalance(ours, costs):7.4f} {bound:7.4f} {ms:8.1f}")


if __name__ == "__main__":
    main()
