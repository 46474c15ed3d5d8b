"""Self-summarization vs truncation on tasks whose episodes exceed the context, the same model and budget.

    make demo-cpt   # runs/tiny/cpt_32k, the checkpoint the gather SFT starts from
    python benchmarks/self_summarization.py [--seeds 1,2,3]

The model is `benchmarks/parallel_tools.py`'s gather SFT checkpoint (the same
`--out` shares it), fine-tuned on gather trajectories that read one file per
message (a sequential k = 5-6 episode is 810-870 tokens) and are cut into
the segments the agent loop makes with `--summary-trigger-tokens T`
(`rl.sft_trajectories.summarized_segments`): at T tokens the expert writes
its summary (the words read so far, the files left, the files written) and
the next segment starts from the task and that summary. Then held-out gather
tasks are run twice at one context `--context` (< T + the summary's room
fails the agent's own check) and one token budget, sampled at temperature 1
with each seed: without summaries (an episode ends when its context is full)
and summarizing at T (`python -m megatron_composer.rl.evaluate
--summary-trigger-tokens`). Prints the fraction of the tasks whose expert
episode exceeds the context, both solve rates per seed and their means, and
plots `docs/self_summarization.png` (solve rate and turns per episode, per seed and mode).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parallel_tools import add_gather_flags, common_flags, done, gather_sft, parse_args, row_values, sh  # noqa: E402

ROW = re.compile(r"^\s*(no summaries|summaries at \d+) \| (.*)$")


def exceeding(args) -> float:
    """The fraction of the held-out tasks whose sequential expert episode is longer than --context."""
    from megatron_composer.data.sft import render_chat
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.rl.sft_trajectories import expert_conversation
    from megatron_composer.rl.tasks.coding import load_tasks

    tok = Tokenizer(args.tokenizer_model)
    tasks = load_tasks(["gather"], "eval", count=args.eval_count)
    lengths = [len(render_chat(expert_conversation(t, batch_reads=False), tok)[0]) for t in tasks]
    return sum(n > args.context for n in lengths) / len(lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gather_flags(p)
    p.add_argument("--context", type=int, default=720, help="one segment's context in the evaluation")
    p.add_argument("--trigger", type=int, default=520, help="--summary-trigger-tokens")
    p.add_argument("--max-summaries", type=int, default=3)
    p.add_argument("--summary-tasks", type=int, default=800, help="summarized expert trajectories in the SFT data")
    p.add_argument("--summary-sft-iters", type=int, default=300)
    p.add_argument("--token-budget", type=int, default=1024, help="generated tokens per episode, both modes")
    p.add_argument("--plot", default="docs/self_summarization.png")
    args = parse_args(p)
    if args.family != "gather":
        p.error(f"--family {args.family}: self-summarization is measured on gather (its episodes outgrow the "
                "context); drop --family")
    started = time.perf_counter()
    sft = gather_sft(args)
    out = os.path.abspath(args.out)
    data = os.path.join(out, "gather_summaries.jsonl")
    if not os.path.exists(data):
        from megatron_composer.data.tokenizer import Tokenizer
        from megatron_composer.rl.sft_trajectories import write_sft_jsonl
        from megatron_composer.rl.tasks.coding import load_tasks

        first = args.prompts_per_step * args.steps + args.tasks  # after the RL tasks and the gather SFT data
        tasks = load_tasks(["gather"], "train", count=first + args.summary_tasks)[first:]
        write_sft_jsonl(data, tasks, workers=8, sequential_reads=1.0,
                        summarize=(Tokenizer(args.tokenizer_model), args.trigger))
    model = os.path.join(out, "sft_summaries")
    if not done(model):
        sh([sys.executable, "pretrain_cpt.py", "--stage", "sft", *common_flags(args), "--data-path", data,
            "--micro-batch-size", "4", "--train-iters", str(args.summary_sft_iters), "--lr", str(args.sft_lr),
            "--min-lr", str(args.sft_lr / 10), "--lr-warmup-iters", "10", "--log-interval", "50",
            "--load", sft, "--finetune", "--save", model], os.path.join(out, "sft_summaries.log"))
    share = exceeding(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    solved: dict[str, list[float]] = {}
    turns: dict[str, list[float]] = {}
    for seed in seeds:
        log = os.path.join(out, f"eval_summaries_seed{seed}.log")
        if not (os.path.exists(log) and "summaries at" in open(log).read()):
            sh([sys.executable, "-m", "megatron_composer.rl.evaluate", "--load", model, "--families", "gather",
                "--count", str(args.eval_count), "--seq-length", str(args.context), "--max-turns", str(args.max_turns),
                "--max-new-tokens", "96", "--token-budget", str(args.token_budget),
                "--summary-trigger-tokens", str(args.trigger), "--max-summaries", str(args.max_summaries),
                "--temperature", "1.0", "--seed", str(seed), "--tokenizer-model", args.tokenizer_model,
                "--data-cache-dir", args.data_cache_dir], log)
        for text in open(log):
            match = ROW.match(text)
            if match:
                mode = "truncation" if match.group(1) == "no summaries" else "summarization"
                row = row_values(match.group(2))
                solved.setdefault(mode, []).append(row["solved"])
                turns.setdefault(mode, []).append(row["turns"])
                print(f"self_summarization {mode} seed {seed}: solved {row['solved']:.3f}, turns "
                      f"{row['turns']:.2f}, summaries per episode {row['summaries']:.2f}", flush=True)
    mean = {mode: sum(v) / len(v) for mode, v in solved.items()}
    print(f"self_summarization: {args.eval_count} held-out gather tasks, {share:.0%} of them with an expert episode "
          f"longer than the {args.context}-token context; solved with summarization {mean['summarization']:.3f} "
          f"(seeds " + " ".join(f"{v:.3f}" for v in solved["summarization"]) + f") vs truncation "
          f"{mean['truncation']:.3f} (seeds " + " ".join(f"{v:.3f}" for v in solved["truncation"])
          + f"); trigger {args.trigger}, up to {args.max_summaries} summaries, budget {args.token_budget} tokens; "
          f"{time.perf_counter() - started:.0f} s")
    if args.plot:
        plot(seeds, solved, turns, args)


def plot(seeds: list[int], solved: dict[str, list[float]], turns: dict[str, list[float]], args) -> None:
    """Per seed, each mode's held-out solve rate and model turns per episode, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.4))
    width = 0.38
    for ax, (values, label) in zip(axes, ((solved, "solved (held-out, sampled)"), (turns, "model turns per episode"))):
        for i, (mode, color) in enumerate((("truncation", "tab:gray"), ("summarization", "tab:blue"))):
            ax.bar([s + (i - 0.5) * width for s in range(len(seeds))], values[mode], width, color=color, label=mode)
        ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
        ax.set_ylabel(label)
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"gather past a {args.context}-token context: summarizing at {args.trigger} vs truncation",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    print(f"self_summarization: plot {args.plot}")


if __name__ == "__main__":
    main()
