"""`async_rl.png`: one asynchronous RL run at a glance (reward, staleness, throughput, weight sync)."""
from __future__ import annotations

from typing import Sequence


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
