#!/usr/bin/env python
"""Several RL runs' logs in one PNG: train success per step (5-step mean) and held-out solved.

    python tools/plot_rl_seeds.py LOG [LOG ...] --output docs/agentic_rl_seeds.png

LOG: train_rl.py's stdout (Megatron-format step lines with `task all_pass`, and `eval at step N:
solved X` lines); each is labelled by its file name.
"""
from __future__ import annotations

import argparse
import os
import re


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--output", required=True)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for path in args.logs:
        text = open(path, errors="replace").read()
        steps = [(int(m.group(1)), float(m.group(2)))
                 for m in re.finditer(r"iteration +(\d+)/ +\d+ \|.*?task all_pass: ([0-9.]+)", text)]
        evals = [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"eval at step (\d+): solved ([0-9.]+)", text)]
        ys = [v for _, v in steps]
        smooth = [sum(ys[max(0, i - 4):i + 1]) / len(ys[max(0, i - 4):i + 1]) for i in range(len(ys))]
        label = os.path.splitext(os.path.basename(path))[0]
        axes[0].plot([s for s, _ in steps], smooth, label=label)
        axes[1].plot([s for s, _ in evals], [v for _, v in evals], "o-", label=label)
    axes[0].set_title("train groups solved (T=1), 5-step mean")
    axes[1].set_title("held-out solved (greedy)")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=90)


if __name__ == "__main__":
    main()
