"""Evaluate a checkpoint as a coding agent on held-out tasks, with and without self-summarization.

    python -m megatron_composer.rl.evaluate --load runs/tiny/agentic_rl_seed1234 \\
        --families write-file --count 64 --seq-length 512

prints one row per mode: solved fraction (every test passes), mean
correctness and reward terms, turns, summaries per trajectory and their
length, stop reasons. With `--summary-trigger-tokens N` it runs each task
twice at the same token budget (`--token-budget`): once without summaries
(the trajectory ends when its context is full) and once summarizing at N
tokens, so the rows compare what summarization buys at equal cost.
Sampling is greedy unless `--temperature` is given.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from .backends import EngineBackend
from .config import RLConfig
from .environments import AgenticEnvironment, build_environment


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_composer.rl.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="a checkpoint directory (root or iter_XXXXXXX)")
    p.add_argument("--tokenizer-model", default=None,
                   help="default: the checkpoint's own, else the embedded corpus's tokenizer")
    p.add_argument("--data-cache-dir", default="data")
    p.add_argument("--families", default="write-file")
    p.add_argument("--split", choices=("train", "eval"), default="eval")
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=512, help="one segment's context")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64, help="per turn")
    p.add_argument("--max-observation-tokens", type=int, default=192)
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--summary-trigger-tokens", type=int, default=None)
    p.add_argument("--summary-max-tokens", type=int, default=96)
    p.add_argument("--max-summaries", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of the episodes (with --temperature): task i samples with seed i + seed x 1000003")
    p.add_argument("--workers", type=int, default=16)
    args = p.parse_args(argv)
    if args.summary_trigger_tokens and not args.token_budget:
        p.error("--summary-trigger-tokens compares the two modes at one budget: give --token-budget too")
    from ..checkpoint import CheckpointError, checkpoint_tokenizer

    try:
        from ..data import default_cpt_data
        from ..data.tokenizer import Tokenizer
        from ..inference.engine import Engine

        model_path = (args.tokenizer_model or checkpoint_tokenizer(args.load)
                      or default_cpt_data(args.data_cache_dir, progress=False).tokenizer_model)
        tokenizer = Tokenizer(model_path)
        engine = Engine.from_checkpoint(args.load, tokenizer=tokenizer, max_model_len=args.seq_length,
                                        max_batch_size=max(args.workers, 1))
        base = RLConfig.from_flat(env=AgenticEnvironment.name, task_families=args.families, max_turns=args.max_turns,
                                  max_new_tokens=args.max_new_tokens, token_budget=args.token_budget,
                                  max_observation_tokens=args.max_observation_tokens, max_summaries=args.max_summaries,
                                  summary_max_tokens=args.summary_max_tokens, episode_workers=max(args.workers, 1))
        modes = [("no summaries", base)]
        if args.summary_trigger_tokens:
            modes.append((f"summaries at {args.summary_trigger_tokens}",
                          base.replace(summary_trigger_tokens=args.summary_trigger_tokens)))
        backend = EngineBackend(engine)
        for i, (name, rl) in enumerate(modes):
            env = build_environment(rl, tokenizer, args.seq_length, split=args.split, count=args.count)
            if i == 0:
                print(f"> {len(env.episodes.tasks())} {args.split} tasks of {rl.environment.task_families}, "
                      f"checkpoint {args.load}")
            backend.start()
            try:
                row = env.evaluate(backend, workers=args.workers, temperature=args.temperature, seed=args.seed)
            finally:
                backend.stop()
            print(f"{name:>22} | " + " | ".join(f"{k[5:]}: {v:.3f}" if isinstance(v, float) else f"{k[5:]}: {v}"
                                                for k, v in row.items()))
    except (ValueError, FileNotFoundError, RuntimeError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
