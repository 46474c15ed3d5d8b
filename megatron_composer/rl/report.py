"""The RL run's report, one for both drivers: the step log and the plots in `--save`.

    rl_steps.jsonl      one JSON line per step: every number the step measured
    reward_curve.png    mean reward per step, its 10-step mean, the held-out solved fraction
    async_rl.png        asynchronous runs: reward, staleness, throughput and weight-sync panels
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch


class StepReport:
    """The RL run's report in `--save` (rank 0 / the driver): `rl_steps.jsonl`, one JSON line of numbers
    per step, `reward_curve.png`, and `async_rl.png` when the rows carry the asynchronous loop's measures."""

    STEP_LOG = "rl_steps.jsonl"
    PLOT = "reward_curve.png"
    ASYNC_PLOT = "async_rl.png"

    def __init__(self, save_dir: Optional[str], title: str, *, job: Optional[str] = None):
        self.save_dir, self.title, self.job = save_dir, title, job
        self.history: list[dict] = []
        self.eval_history: list[dict] = []

    def step(self, row: dict) -> None:
        self.history.append(row)
        if not self.save_dir:
            return
        os.makedirs(self.save_dir, exist_ok=True)
        line = {k: v for k, v in row.items() if isinstance(v, (int, float, dict, list))}
        if self.job is not None:
            line["job"] = self.job
        with open(os.path.join(self.save_dir, self.STEP_LOG), "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def evaluation(self, row: dict) -> None:
        self.eval_history.append(row)

    def plot(self) -> Optional[str]:
        if not self.save_dir or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [h["iteration"] for h in self.history]
        rewards = torch.tensor([h["reward"] for h in self.history], dtype=torch.float64)
        window = min(10, len(rewards))
        smooth = torch.nn.functional.avg_pool1d(rewards[None, None], window, 1).flatten()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, rewards.tolist(), alpha=0.4, label="mean reward")
        ax.plot(steps[window - 1:], smooth.tolist(), label=f"{window}-step mean")
        if self.eval_history:
            ax.plot([h["iteration"] for h in self.eval_history], [h["eval solved"] for h in self.eval_history],
                    "o-", label="held-out solved (greedy)")
            passk = [h for h in self.eval_history if "eval pass@k" in h]
            if passk:
                ax.plot([h["iteration"] for h in passk], [h["eval pass@k"] for h in passk], "s--",
                        label="held-out pass@k")
        ax.set_xlabel("RL step")
        ax.set_ylabel("reward")
        ax.set_title(self.title, fontsize=9)
        ax.legend()
        fig.tight_layout()
        os.makedirs(self.save_dir, exist_ok=True)
        path = os.path.join(self.save_dir, self.PLOT)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        if all("staleness" in h for h in self.history):
            plot_async_run(self.history, self.eval_history, os.path.join(self.save_dir, self.ASYNC_PLOT))
        return path


def plot_async_run(history: Sequence[dict], evals: Sequence[dict], path: str) -> str:
    """Four panels from the runner's per-step rows and evaluations; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["iteration"] for h in history]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    ax = axes[0][0]
    ax.plot(steps, [h["reward"] for h in history], "o-", ms=3, label="mean reward (train groups)")
    if evals:
        ax.plot([e["iteration"] for e in evals], [e["eval solved"] for e in evals], "s-", label="held-out solved")
    ax.set_title("reward")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    lags = sorted({int(k) for h in history for k in h["staleness"]})
    bottom = [0.0] * len(history)
    for lag in lags:
        share = [h["staleness"].get(str(lag), 0.0) for h in history]
        ax.bar(steps, share, bottom=bottom, label=f"lag {lag}")
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set_title("staleness of trained tokens (versions behind)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(steps, [h["samples/s"] for h in history], label="samples/s")
    ax.plot(steps, [h["trainer idle fraction"] for h in history], label="trainer idle fraction")
    ax.plot(steps, [h["inference idle fraction"] for h in history], label="inference idle fraction")
    ax.set_title("throughput and idle time (cumulative)")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    sent = [h.get("sync bytes", 0.0) / 1e6 for h in history]
    full = [h.get("sync full bytes", 0.0) / 1e6 for h in history]
    ax.plot(steps, full, label="full upload (MB)")
    ax.plot(steps, sent, label="sent: delta, compressed (MB)")
    ax.set_title("weight sync per step")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.set_xlabel("RL step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
