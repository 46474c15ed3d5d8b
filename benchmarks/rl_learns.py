"""RL learns: held-out pass@1 of execution-verified tasks, RL vs an `--lr 0` control, paired over seeds.

    make demo-cpt   # runs/tiny/cpt_32k, the checkpoint the gather SFT starts from
    python benchmarks/rl_learns.py [--seeds 1,2,3] [--steps 10]

The checkpoint is ours end to end: `make demo-cpt`'s CPT (tiny preset, our
tokenizer, trained from random initialization on the embedded code corpus),
then SFT on scripted expert `gather` trajectories
(`benchmarks/parallel_tools.py` builds it; the same `--out` shares the
checkpoint and the RL arm's runs with that benchmark). The tasks are the
`gather` family: read k = 3-6 files, write their words to answer.txt; a task
is solved when its hidden pytest tests pass in the bubblewrap sandbox.
`--family write-file` measures on write-file tasks instead (create one file
with an exact short text, the family `examples/tiny/agentic_rl.sh` fine-tunes
on): RL starts from `--load` itself (default runs/tiny/agent_sft_model), with that script's context and turns.

Two arms per seed, the same tasks, sampling and steps: "RL" (`--lr`, reward
correctness + all_pass + 0.1 x tool misuse) and "control" (`--lr 0`: the same
rollouts and loss, weights never move; the routers' expert biases still
balance). pass@1 is greedy on `--eval-count` held-out tasks of the eval
split, before RL and after each run. Prints the starting pass@1 (the issue
asks for one between 0.1 and 0.6), each seed's pass@1 in both arms, the
means, the per-seed differences RL - control and a paired t-test on them
(two-sided p from Student's t with n - 1 degrees of freedom), and plots
`docs/rl_learns.png`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parallel_tools import (add_gather_flags, gather_sft, held_out, parse_args, read_steps, rl_run,  # noqa: E402
                            sft_result)


def student_t_two_sided(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom (Simpson's rule on the density;
    written here because the benchmark needs only this one number and scipy is not a dependency)."""
    if math.isinf(t):
        return 0.0
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    density = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    n, a = 20_000, abs(t)
    h = a / n
    area = density(0) + density(a) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, n))
    return max(0.0, 1.0 - 2 * area * h / 3)


def paired_t(differences: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of the paired t-test on `differences` (mean 0 under the null)."""
    n = len(differences)
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1)) if n > 1 else 0.0
    if sd <= 1e-12 * max(1.0, abs(mean)):  # equal differences (up to rounding): no spread to test against
        return (math.inf if mean else 0.0), (0.0 if mean else 1.0)
    t = mean / (sd / math.sqrt(n))
    return t, student_t_two_sided(t, n - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gather_flags(p)
    p.add_argument("--plot", default="docs/rl_learns.png")
    args = parse_args(p)
    started = time.perf_counter()
    sft = gather_sft(args)
    out = os.path.abspath(args.out)
    start = sft_result(args)[1]  # held-out pass@1 (greedy) where SFT stopped
    verdict = "inside" if 0.1 <= start <= 0.6 else "OUTSIDE"
    print(f"rl_learns: held-out pass@1 after SFT {start:.3f} ({verdict} the asked range 0.1-0.6; "
          f"{args.eval_count} held-out {args.family} tasks, greedy)", flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    ends: dict[str, list[float]] = {"RL": [], "control": []}
    curves: dict[str, list[list[dict]]] = {"RL": [], "control": []}
    for seed in seeds:
        for arm, name, lr in (("RL", "rl", args.lr), ("control", "control", "0")):
            run = rl_run(args, sft, name, seed, args.reward, lr)
            curves[arm].append(read_steps(run))
            ends[arm].append(held_out(run, args, os.path.join(out, f"eval_{name}_seed{seed}_greedy.log"),
                                      temperature=0.0)["solved"])
            print(f"rl_learns {arm} seed {seed}: held-out pass@1 {start:.3f} -> {ends[arm][-1]:.3f} "
                  f"({ends[arm][-1] - start:+.3f})", flush=True)
    diffs = [a - b for a, b in zip(ends["RL"], ends["control"])]
    t, p_value = paired_t(diffs)
    mean = {arm: sum(v) / len(v) for arm, v in ends.items()}
    for arm, values in ends.items():
        print(f"rl_learns {arm}: pass@1 per seed " + " ".join(f"{v:.3f}" for v in values)
              + f"; mean {mean[arm]:.3f} ({mean[arm] - start:+.3f} from {start:.3f})")
    print("rl_learns: RL - control per seed " + " ".join(f"{d:+.3f}" for d in diffs)
          + f"; mean {sum(diffs) / len(diffs):+.3f}; paired t = {t:.2f}, two-sided p = {p_value:.3f} "
          f"(n = {len(diffs)}); RL gain {mean['RL'] - start:+.3f} (target >= +0.15); {args.steps} steps of "
          f"{args.prompts_per_step} x {args.group_size}, lr {args.lr}; {time.perf_counter() - started:.0f} s")
    if args.plot:
        plot(start, ends, curves, args)


def plot(start: float, ends: dict, curves: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    colors = {"RL": "tab:blue", "control": "tab:gray"}
    for arm, runs in curves.items():
        values = [[row.get("task all_pass", 0.0) for row in run] for run in runs]
        steps = list(range(1, len(values[0]) + 1))
        for v in values:
            left.plot(steps, v, color=colors[arm], alpha=0.25, linewidth=1)
        left.plot(steps, [sum(v[i] for v in values) / len(values) for i in range(len(steps))], color=colors[arm],
                  linewidth=2.2, label=f"{arm} (mean of {len(values)} seeds)")
    left.set_xlabel("RL step")
    left.set_ylabel("training solve rate (sampled)")
    left.set_ylim(0, 1)
    left.legend(fontsize=8)
    for i, arm in enumerate(ends):
        xs = [i + 0.1 * (j - 1) for j in range(len(ends[arm]))]
        right.scatter(xs, ends[arm], color=colors[arm], zorder=3)
        right.hlines(sum(ends[arm]) / len(ends[arm]), i - 0.25, i + 0.25, color=colors[arm], linewidth=2.2)
    right.axhline(start, color="black", linestyle=":", label=f"after SFT {start:.2f}")
    right.set_xticks(range(len(ends)), [f"{arm} (lr {args.lr if arm == 'RL' else 0})" for arm in ends])
    right.set_ylabel(f"held-out pass@1 (greedy, {args.eval_count} tasks)")
    right.set_ylim(0, 1)
    right.legend(fontsize=8)
    fig.suptitle(f"{args.family} tasks, execution-verified: RL vs an lr-0 control, per seed", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    print(f"rl_learns: plot {args.plot}")


if __name__ == "__main__":
    main()
