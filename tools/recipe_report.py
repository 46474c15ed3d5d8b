#!/usr/bin/env python
"""The report of one run of the whole recipe (`examples/tiny/recipe.sh`, `make demo`).

    python tools/recipe_report.py --run-dir runs/demo [--seconds 540]

Reads each stage's log in RUN_DIR/logs (Megatron-format lines) and the RL
step log (rl/rl_steps.jsonl), measures the MTP layer's acceptance rate
in speculative decoding for each stage's checkpoint (temperature 1, batch 1,
held-out standard-library prompts), and writes RUN_DIR/report.md with three
plots (report_loss.png, report_reward.png, report_acceptance.png) and a
summary table, which it also prints.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*")
_EVAL = re.compile(r"eval of weights version (\d+): solved ([0-9.]+) of (\d+) held-out tasks, correctness ([0-9.]+)")
STAGES = (("cpt_32k", "CPT 32K stage"), ("cpt_256k", "256K stage, CP=2 on 2 ranks"),
          ("mtp", "MTP self-distillation (frozen trunk)"), ("sft", "SFT on agent trajectories"))


def log_series(path: str, key: str) -> list[tuple[int, float]]:
    """(iteration, value of `key`) from the Megatron-format lines of a log."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = _LINE.search(line)
            v = re.search(re.escape(key) + r": ([-+0-9.eE]+)", line)
            if m and v:
                out.append((int(m.group(1)), float(v.group(1))))
    return out


def rl_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "rl", "rl_steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    last = {}
    for r in rows:  # a resumed run repeats steps: keep each step's newest row
        last[r["iteration"]] = r
    return [last[k] for k in sorted(last)]


def rl_evals(run_dir: str) -> list[tuple[int, float, float]]:
    path = os.path.join(run_dir, "logs", "rl.log")
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [(int(m.group(1)), float(m.group(2)), float(m.group(4))) for m in _EVAL.finditer(f.read())]


def acceptance(checkpoint: str, data_dir: str, prompts: int = 3, new_tokens: int = 24) -> float | None:
    """The MTP draft's acceptance rate at temperature 1 on held-out prompts (None: no checkpoint)."""
    from megatron_composer.checkpoint import is_checkpoint_dir

    if not is_checkpoint_dir(checkpoint):
        return None
    from megatron_composer.data.indexed import document_prefixes
    from megatron_composer.inference import SamplingParams
    from megatron_composer.inference.engine import Engine

    engine = Engine.from_checkpoint(checkpoint, max_model_len=256, max_batch_size=1)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, speculative="mtp")
    proposed = accepted = 0
    for prompt in document_prefixes(os.path.join(data_dir, "stdlib_valid"), prompts, 64, 64 + new_tokens):
        spec = engine.generate([prompt], params)[0].speculative
        proposed, accepted = proposed + spec.proposed, accepted + spec.accepted
    return accepted / proposed if proposed else 0.0


def _plots(run_dir: str, losses: dict, rows: list[dict], evals: list, accept: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(run_dir, name), dpi=90)
        plt.close(fig)
        files.append(name)

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    offset = 0
    for name, label in STAGES:
        series = losses.get(name) or []
        if series:
            ax.plot([offset + i for i, _ in series], [v for _, v in series], "o-", ms=2, label=label)
            offset += series[-1][0]
    ax.set_xlabel("optimizer step (stages one after another)")
    ax.set_ylabel("lm loss (MTP stage: mtp loss)")
    ax.legend(fontsize=7)
    save(fig, "report_loss.png")

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    if rows:
        ax.plot([r["iteration"] for r in rows], [r["reward"] for r in rows], "o-", ms=3, label="mean reward")
        ax.plot([r["iteration"] for r in rows], [r.get("task correctness", 0.0) for r in rows], "s-", ms=3,
                label="fraction of tests passing")
    if evals:
        ax.plot([e[0] for e in evals], [e[2] for e in evals], "^--", label="held-out tests passing (greedy)")
    ax.set_xlabel("asynchronous RL step")
    ax.legend(fontsize=7)
    save(fig, "report_reward.png")

    fig, ax = plt.subplots(figsize=(6.5, 3.0))
    names = [n for n in accept if accept[n] is not None]
    ax.bar(names, [accept[n] for n in names])
    ax.set_ylabel("MTP draft acceptance (T=1)")
    ax.set_ylim(0, 1)
    save(fig, "report_acceptance.png")
    return files


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def report(run_dir: str, data_dir: str, seconds: float | None = None) -> str:
    losses = {name: log_series(os.path.join(run_dir, "logs", f"{name}.log"),
                               "mtp loss" if name == "mtp" else "lm loss") for name, _ in STAGES}
    rows, evals = rl_rows(run_dir), rl_evals(run_dir)
    accept = {name: acceptance(os.path.join(run_dir, name), data_dir) for name in ("cpt_32k", "mtp", "sft", "rl")}
    files = _plots(run_dir, losses, rows, evals, accept)
    table = ["| stage | steps | first → last | MTP acceptance |", "|---|---|---|---|"]
    for name, label in STAGES:
        s = losses[name]
        what = "mtp loss" if name == "mtp" else "lm loss"
        span = f"{what} {s[0][1]:.3f} → {s[-1][1]:.3f}" if s else "not run"
        a = accept.get(name)
        table.append(f"| {label} | {s[-1][0] if s else 0} | {span} | {'' if a is None else f'{a:.2f}'} |")
    if rows:
        k = max(1, len(rows) // 3)
        first, last = rows[:k], rows[-k:]
        span = (f"mean reward {_mean(r['reward'] for r in first):.3f} → {_mean(r['reward'] for r in last):.3f} "
                f"(first / last {k} steps); tests passing {_mean(r.get('task correctness', 0) for r in first):.3f} "
                f"→ {_mean(r.get('task correctness', 0) for r in last):.3f}")
        if evals:
            span += f"; held-out {evals[0][2]:.3f} → {evals[-1][2]:.3f} (greedy, version {evals[0][0]} → {evals[-1][0]})"
        a = accept.get("rl")
        table.append(f"| asynchronous agentic RL | {rows[-1]['iteration']} | {span} | {'' if a is None else f'{a:.2f}'} |")
        r = rows[-1]
        table.append(f"| RL systems | | staleness mean {_mean(x['staleness mean'] for x in rows):.2f} versions; "
                     f"trainer idle {r['trainer idle fraction']:.2f}, inference idle {r['inference idle fraction']:.2f}; "
                     f"weight sync {_mean(x.get('sync bytes', 0) for x in rows[1:]) / 1e6:.2f} MB delta vs "
                     f"{r.get('sync full bytes', 0) / 1e6:.2f} MB bf16 | |")
    lines = ["# Recipe report", ""]
    if seconds is not None:
        lines += [f"The whole recipe took {seconds / 60:.1f} minutes.", ""]
    lines += table + [""] + [f"![{f}]({f})" for f in files] + [""]
    text = "\n".join(lines)
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--seconds", type=float, default=None, help="the recipe's wall time, for the report")
    args = p.parse_args()
    if not os.path.isdir(os.path.join(args.run_dir, "logs")):
        print(f"error: {args.run_dir}/logs does not exist; run examples/tiny/recipe.sh (make demo) first",
              file=sys.stderr)
        return 2
    print(report(args.run_dir, args.data_dir, args.seconds))
    print(f"> wrote {os.path.join(args.run_dir, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
