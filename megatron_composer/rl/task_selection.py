"""Harder tasks, not saturated ones: groups without signal, and tasks chosen by their solve rate.

    zero_signal_groups(rewards)            [G, n] rewards -> [G] bool, every sample of the group alike
    trained_groups(zero, per_mini, least)  the groups an update packs under --drop-zero-signal-groups
    SolveRates()                           per-task solve-rate estimates (below)
    select_tasks(rates, count, cursor, bounds)  the step's task indices and the next cursor
    TaskSelector(bounds)                   both over an environment's pool, with its metrics and state

Zero-signal groups. A group whose samples all got the same reward has a zero
advantage under every estimator here (`algorithms`: reward minus the group's
mean, or its leave-one-out mean; GRPO's std is 0 too), so its policy-loss
tokens carry no gradient, and with one constant normalizer per step
(`default_normalizer`) removing them leaves the rest of the step's loss as
it was: the gradient is the same bit for bit in a dense model, and to float
rounding with MoE layers (their expert GEMMs batch other tokens). `--drop-zero-signal-groups` leaves them out of packing and the
forward/backward (`RLTrainer.prepare`); every step counts them either way.
Two exceptions make the drop more than a saving: rounding in the group mean
(a group of three samples of 0.1 gets Dr.GRPO advantages of -1.4e-17 in
float64, not 0; groups of a power-of-two size, or of rewards 0 and 1, are
exact), and the terms that do
not go through the advantage (the KL in the loss, MTP, the feedback KL),
whose share of those samples is dropped too. "The same reward" is the
verdicts' weighted sum before any KL penalty.

Solve-rate selection (`--task-selection solve-rate`). A task's estimate is the
posterior mean of its solve probability under a Beta(1, 1) prior:

    rate = (solved + 1) / (samples + 2)

(Laplace's rule of succession), where a sample is solved when its verdict's
`all_pass` is 1 (or, for tasks without it, `correctness` is 1). An unseen
task is 0.5, so it is tried; one group of 8 all solved makes it 0.9, all
failed 0.1. A step takes its tasks in pool order from a cursor, skipping
those whose rate is outside `[low, high]` (both ends included), each task
at most once unless fewer are eligible than the step needs (then they
repeat, in order); the cursor moves past the last task taken. When no task
is eligible the step takes the next tasks regardless (counted as a
fallback). Estimates and cursor are the same on every rank (updated from
the gathered samples) and are saved with the checkpoint.
"""
from __future__ import annotations

import torch

SELECTIONS = ("cycle", "solve-rate")
PRIOR_SOLVED, PRIOR_FAILED = 1.0, 1.0  # Beta(1, 1)


def zero_signal_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[G] bool: groups whose samples all share one reward. rewards: [G, n] float."""
    return (rewards == rewards[:, :1]).all(dim=1)


def trained_groups(zero: torch.Tensor, groups_per_mini: int, least: int = 1) -> list[int]:
    """The groups with a signal, mini-batch by mini-batch (`groups_per_mini` consecutive groups each); a
    mini-batch keeps at least `least` groups, its zero-signal ones in order if it must: their policy-loss
    gradient is zero, and an update without samples would still move the optimizer (under expert
    parallelism or HSDP, `least` gives every data-parallel rank a sample). zero: [G] bool."""
    kept = []
    for start in range(0, len(zero), groups_per_mini):
        mini = range(start, min(start + groups_per_mini, len(zero)))
        keep = [g for g in mini if not zero[g]]
        kept += sorted(keep + [g for g in mini if zero[g]][:max(0, least - len(keep))])
    return kept


def solved(verdict: dict) -> bool:
    """Whether one sample's verdict solved its task (module docstring)."""
    if "all_pass" in verdict:
        return verdict["all_pass"] >= 1.0
    return verdict.get("correctness", 0.0) >= 1.0


def parse_bounds(text: str) -> tuple[float, float]:
    """"0.1,0.9" -> (0.1, 0.9); ValueError naming the flag otherwise."""
    parts = text.split(",")
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"--task-solve-rate-bounds {text!r}: give two numbers LOW,HIGH, e.g. 0.1,0.9") from None
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"--task-solve-rate-bounds {text!r}: need 0 <= LOW <= HIGH <= 1, e.g. 0.1,0.9")
    return low, high


class SolveRates:
    """Per-task counts of solved samples and samples (by task key), and the estimate of each."""

    def __init__(self):
        self.counts: dict[str, list[int]] = {}  # key -> [solved, samples]

    def rate(self, key: str) -> float:
        s, n = self.counts.get(key, (0, 0))
        return (s + PRIOR_SOLVED) / (n + PRIOR_SOLVED + PRIOR_FAILED)

    def update(self, key: str, solved_count: int, samples: int) -> None:
        counts = self.counts.setdefault(key, [0, 0])
        counts[0] += int(solved_count)
        counts[1] += int(samples)

    def state_dict(self) -> dict:
        return {"counts": {k: list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {str(k): [int(v[0]), int(v[1])] for k, v in state.get("counts", {}).items()}


def select_tasks(rates: list[float], count: int, cursor: int, bounds: tuple[float, float]) -> tuple[list[int], int, bool]:
    """(the indices of `count` tasks, the next cursor, whether no task was eligible) for tasks of
    estimates `rates` in pool order (module docstring)."""
    n = len(rates)
    low, high = bounds
    eligible = [i for i in range(n) if low <= rates[i] <= high]
    fallback = not eligible
    order = sorted(eligible or range(n), key=lambda i: (i - cursor) % n)
    taken = [order[j % len(order)] for j in range(count)]
    return taken, (taken[-1] + 1) % n, fallback


class TaskSelector:
    """`--task-selection solve-rate` over an environment's pool (by `env.task_key`): the estimates, the
    cursor, and the metrics of the last step. The same on every rank: each step's choice depends on the
    estimates only, and every rank observes the same gathered samples."""

    def __init__(self, bounds: tuple[float, float]):
        self.bounds, self.rates, self.cursor = bounds, SolveRates(), 0
        self.metrics: dict = {}

    def _estimates(self, env) -> list[float]:
        return [self.rates.rate(env.task_key(i)) for i in range(len(env.pool))]

    def choose(self, env, count: int) -> list[int]:
        """The pool indices of a step's `count` groups (`select_tasks`)."""
        rates = self._estimates(env)
        chosen, self.cursor, fallback = select_tasks(rates, count, self.cursor, self.bounds)
        self.metrics = {"selection fallback": float(fallback),
                        "selected solve rate": sum(rates[i] for i in chosen) / count}
        return chosen

    def observe(self, env, chosen: list[int], samples) -> None:
        """Count the step's samples (step-local group j ran pool[chosen[j]]; each trajectory's verdict once)."""
        heads: dict = {}
        for s in samples:
            heads.setdefault(s.trajectory, s)
        for j, index in enumerate(chosen):
            group = [h for h in heads.values() if h.group == j]
            self.rates.update(env.task_key(index), sum(solved(h.rewards) for h in group), len(group))
        low, high = self.bounds
        rates = self._estimates(env)
        self.metrics.update({"tasks in bounds": sum(low <= r <= high for r in rates) / len(rates),
                             "tasks seen": float(len(self.rates.counts))})

    def state_dict(self) -> dict:
        return dict(self.rates.state_dict(), cursor=self.cursor)

    def load_state_dict(self, state: dict) -> None:
        self.rates.load_state_dict(state)
        self.cursor = int(state.get("cursor", 0))
