"""The concave length penalty: effort and pass@1 over RL with and without it, the same tasks and seeds.

    make demo-cpt   # runs/tiny/cpt_32k, the checkpoint the gather SFT starts from
    python benchmarks/length_penalty.py [--seeds 1,2,3] [--steps 10]

The `gather` SFT checkpoint and the "RL" arm are `benchmarks/parallel_tools.py`'s
(the same `--out` shares them): read k = 3-6 files, write their words, with a
habit of reading one file per message 70% of the time. The second arm adds
`length=W` to the reward: -C(x), the concave penalty of `rl.rewards` (k, q at
their defaults) of the effort x = every generated and tool-output token once
plus 16 per model turn (`--effort-weights`, also what both arms log). An
episode can spend less by batching its reads (fewer turns), by not reading a
file twice and by ending once the answer is written. Prints, per arm and
seed, the effort and the training solve rate (sampled) over the first and
last 3 steps and the held-out pass@1 (greedy) after RL, the means, and plots
`docs/length_penalty.png` (effort and solve rate per step). `--family
write-file`: the same two arms on write-file tasks from `--load` itself (its
`--out` shares the RL arm with `rl_learns.py --family write-file`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parallel_tools import (add_gather_flags, gather_sft, held_out, parse_args, read_steps, rl_run,  # noqa: E402
                            sft_result)

ARMS = (("RL", "rl"), ("RL + length penalty", "length"))


def window(rows: list[dict], key: str, last: bool) -> float:
    part = rows[-3:] if last else rows[:3]
    return sum(r[key] for r in part) / len(part)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gather_flags(p)
    p.add_argument("--length-weight", default="0.005", help="W of the length term in the second arm")
    p.add_argument("--plot", default="docs/length_penalty.png")
    args = parse_args(p)
    started = time.perf_counter()
    sft = gather_sft(args)
    out = os.path.abspath(args.out)
    start = sft_result(args)[1]  # held-out pass@1 (greedy) where SFT stopped
    seeds = [int(s) for s in args.seeds.split(",")]
    curves: dict[str, list[list[dict]]] = {arm: [] for arm, _ in ARMS}
    ends: dict[str, list[float]] = {arm: [] for arm, _ in ARMS}
    for seed in seeds:
        for arm, name in ARMS:
            reward = args.reward + (f",length={args.length_weight}" if name == "length" else "")
            run = rl_run(args, sft, name, seed, reward, args.lr)
            rows = read_steps(run)
            curves[arm].append(rows)
            ends[arm].append(held_out(run, args, os.path.join(out, f"eval_{name}_seed{seed}_greedy.log"),
                                      temperature=0.0)["solved"])
            print(f"length_penalty {arm} seed {seed}: effort {window(rows, 'effort', False):.1f} -> "
                  f"{window(rows, 'effort', True):.1f}, training solve rate {window(rows, 'task all_pass', False):.3f} "
                  f"-> {window(rows, 'task all_pass', True):.3f} (steps 1-3 -> last 3), held-out pass@1 "
                  f"{start:.3f} -> {ends[arm][-1]:.3f}", flush=True)
    summary = {}
    for arm, _ in ARMS:
        runs = curves[arm]
        first = sum(window(r, "effort", False) for r in runs) / len(runs)
        last = sum(window(r, "effort", True) for r in runs) / len(runs)
        solve = sum(window(r, "task all_pass", True) for r in runs) / len(runs)
        pass1 = sum(ends[arm]) / len(ends[arm])
        summary[arm] = (last, pass1)
        print(f"length_penalty {arm}, mean of seeds {args.seeds}: effort {first:.1f} -> {last:.1f} "
              f"({last / first - 1:+.1%}); training solve rate over the last 3 steps {solve:.3f}; held-out pass@1 "
              f"{pass1:.3f} (per seed " + " ".join(f"{v:.3f}" for v in ends[arm]) + ")")
    (base_effort, base_pass), (pen_effort, pen_pass) = summary["RL"], summary["RL + length penalty"]
    print(f"length_penalty: effort over the last 3 steps, penalty / none = {pen_effort / base_effort:.2f}; held-out "
          f"pass@1 {pen_pass:.3f} vs {base_pass:.3f} ({pen_pass - base_pass:+.3f}); length={args.length_weight}, "
          f"effort weights {args.effort_weights}; {args.steps} steps of {args.prompts_per_step} x "
          f"{args.group_size}, lr {args.lr}; {time.perf_counter() - started:.0f} s")
    if args.plot:
        plot(curves, args)


def plot(curves: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
    for ax, (key, label) in zip(axes, (("effort", f"effort x ({args.effort_weights}, tokens 1)"),
                                       ("task all_pass", "training solve rate (sampled)"))):
        for (arm, runs), color in zip(curves.items(), ("tab:gray", "tab:orange")):
            values = [[row[key] for row in run] for run in runs]
            steps = list(range(1, len(values[0]) + 1))
            for v in values:
                ax.plot(steps, v, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, [sum(v[i] for v in values) / len(values) for i in range(len(steps))], color=color,
                    linewidth=2.2, label=f"{arm} (mean of {len(values)} seeds)")
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{args.family}: RL with and without the length penalty (length={args.length_weight})", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    print(f"length_penalty: plot {args.plot}")


if __name__ == "__main__":
    main()
