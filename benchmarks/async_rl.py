"""Asynchronous vs synchronous RL on the same machine, same groups, long-tailed rollout lengths.

    python benchmarks/async_rl.py [--steps 12] [--prompts-per-step 2] [--group-size 4] [--max-new-tokens 96]

Both runs are the Ray services of `rl/async_rl` on the tiny model (random
init, single-turn task, reward = correctness + a length penalty, so that
every group has nonzero advantages and every step a real update): the baseline (`--synchronous-rollouts`) samples one
step's groups only while the trainer waits, the way a synchronous RL loop
does; the asynchronous run keeps `--max-inflight-groups` groups sampling
while the trainer steps and swaps weights in flight (policy lag <= 2). Each
sample's length is drawn from a Pareto distribution (shape `--tail`, median
about max / 8, stop tokens off), so a synchronous step waits for its longest
sample. Prints the wall time of each run's loop (actor start-up excluded),
the trainer's idle fraction, and the ratio synchronous / asynchronous.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_composer.rl.async_rl.runner import AsyncRLRunner  # noqa: E402


def run(mode: str, args, save: str) -> dict:
    argv = ["--async-rl", "--model-preset", "tiny", "--seq-length", "256", "--rl-micro-batch-tokens", "2048",
            "--train-iters", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
            "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
            "--lr", "1e-4", "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--log-interval", "1",
            "--rollout-long-tail", str(args.tail), "--max-inflight-groups", str(2 * args.prompts_per_step),
            "--max-policy-lag", "2", "--save", save, "--save-interval", "1000", "--seed", "7",
            # the length penalty differs between samples of a group, so every step does a real update
            "--reward", "correctness=1.0,length=0.1"]
    if mode == "synchronous":
        argv.append("--synchronous-rollouts")
    runner = AsyncRLRunner(argv)
    try:
        return runner.run()
    finally:
        runner.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--tail", type=float, default=1.2)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for mode in ("synchronous", "asynchronous"):
            results[mode] = run(mode, args, os.path.join(tmp, mode))
    sync, asyn = results["synchronous"], results["asynchronous"]
    groups = args.steps * args.prompts_per_step
    print(f"async_rl: {groups} groups of {args.group_size}, lengths Pareto({args.tail:g}) up to "
          f"{args.max_new_tokens} tokens | synchronous {sync['wall seconds']:.1f} s, trainer idle "
          f"{sync['trainer idle fraction']:.2f} | asynchronous {asyn['wall seconds']:.1f} s, trainer idle "
          f"{asyn['trainer idle fraction']:.2f} | async speedup {sync['wall seconds'] / asyn['wall seconds']:.2f}x")


if __name__ == "__main__":
    main()
