"""Parallel tool calls: RL with and without the tool-use reward terms, turns per solved episode.

    make demo-cpt   # runs/tiny/cpt_32k, the checkpoint the gather SFT starts from
    python benchmarks/parallel_tools.py [--seeds 1,2,3] [--steps 10]

1. SFT data: expert trajectories of the `gather` family (read k = 3-6 files
   of one word each, then write the words to answer.txt; `rl.tasks.coding.gather`),
   of which `--sequential-reads` read one file per message and the rest make
   all k reads in one list of calls (`rl.sft_trajectories`). The habit the
   model starts RL with is this mixture: an episode takes k + 2 turns when it
   reads one file at a time, 3 when it batches (reads, write, finish).
2. SFT from `--load` (default runs/tiny/cpt_32k, the CPT checkpoint of `make demo-cpt`)
   at `--seq-length` 1024 (a sequential k = 6 trajectory is about 870 tokens),
   in chunks of `--sft-chunk` steps, until the held-out pass@1 (greedy) reaches
   `--sft-stop-pass1`: RL needs a model that solves some tasks and not others.
3. RL from that checkpoint on training gather tasks, the same seeds, tasks and
   steps for both arms: "RL" with the task reward (correctness + all_pass +
   0.1 x tool misuse) and "RL + tool terms" with `--terms` added
   (parallel_tool_calls and tool_efficiency, `rl.agentic_rewards`).
4. Held-out: `--eval-count` gather tasks of the eval split, sampled at
   temperature 1 (greedy would turn a 60/40 habit into 100/0), after SFT and
   after each run: solve rate, turns per solved episode, calls per turn.
   Prints each run's line, the means over seeds, the ratio of turns per
   solved episode (RL / RL + tool terms) and the solve rates side by side,
   and plots `docs/parallel_tools.png` (training turns per episode and solve
   rate per step, both arms).
Steps already done (data, SFT, finished runs) are skipped when rerun with the same `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ARMS = (("RL", "rl"), ("RL + tool terms", "terms"))
# per family: the starting checkpoint, and the context, turns and tokens per turn of its episodes (write-file:
# examples/tiny/agentic_rl.sh's)
FAMILY_DEFAULTS = {"gather": dict(load="runs/tiny/cpt_32k", seq_length=1024, max_turns=10, max_new_tokens=160),
                   "write-file": dict(load="runs/tiny/agent_sft_model", seq_length=512, max_turns=3,
                                      max_new_tokens=64)}


def parse_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    """`p`'s arguments with the family's defaults filled in where a flag was not given."""
    args = p.parse_args()
    for key, value in FAMILY_DEFAULTS[args.family].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = f"runs/{args.family.replace('-', '_')}_rl"
    return args


def sh(argv: list[str], log: str) -> str:
    print("$ " + " ".join(argv[:4]) + " ...  (log: " + log + ")", flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    text = open(log).read()
    if code:
        raise SystemExit(f"command failed ({code}), see {log}:\n{text[-2000:]}")
    print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
    return text


def done(path: str) -> bool:
    from megatron_composer.checkpoint import is_checkpoint_dir

    return is_checkpoint_dir(path)


def held_out(checkpoint: str, args, log: str, temperature: float = 1.0) -> dict:
    """rl.evaluate's row for `checkpoint` on the held-out tasks of `--family` (sampled at `temperature`,
    greedy at 0), cached in `log`."""
    if not (os.path.exists(log) and "solved:" in open(log).read()):
        sh([sys.executable, "-m", "megatron_composer.rl.evaluate", "--load", checkpoint, "--families", args.family,
            "--count", str(args.eval_count), "--seq-length", str(args.seq_length), "--max-turns", str(args.max_turns),
            "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(temperature),
            "--tokenizer-model", args.tokenizer_model, "--data-cache-dir", args.data_cache_dir], log)
    row = [line for line in open(log) if "solved:" in line][-1]
    return row_values(row.split(" | ", 1)[1])


def row_values(text: str) -> dict[str, float]:
    """The `name: value` pairs of an `rl.evaluate` summary row (values may be negative: tool misuse)."""
    return {k: float(v) for k, v in re.findall(r"([a-z][a-z ]*): (-?[0-9.]+)", text)}


def common_flags(args) -> list[str]:
    return ["--model-preset", "tiny", "--tokenizer-model", args.tokenizer_model,
            "--data-cache-dir", args.data_cache_dir, "--seq-length", str(args.seq_length)]


def gather_sft(args) -> str:
    """The SFT checkpoint (steps 1-2 of the module docstring), built once per `--out`. With `--family`
    other than gather, RL starts from `--load` itself (an SFT checkpoint for that family) and only its
    held-out pass@1 is recorded."""
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    stop = os.path.join(out, "sft_done.txt")  # written when SFT stopped: its last iteration and pass@1
    if args.family != "gather":
        if not os.path.exists(stop):
            pass1 = held_out(os.path.abspath(args.load), args, os.path.join(out, "eval_sft0_greedy.log"),
                             temperature=0.0)["solved"]
            with open(stop, "w") as f:
                f.write(f"0 {pass1}\n")
        return os.path.abspath(args.load)
    data = os.path.join(out, "gather_sft.jsonl")
    if not os.path.exists(data):
        from megatron_composer.rl.sft_trajectories import write_sft_jsonl
        from megatron_composer.rl.tasks.coding import load_tasks

        # RL's tasks are the first prompts-per-step x steps of the split; the SFT data starts after them
        first = args.prompts_per_step * args.steps
        tasks = load_tasks(["gather"], "train", count=first + args.tasks)[first:]
        write_sft_jsonl(data, tasks, workers=8, sequential_reads=args.sequential_reads)
    sft = os.path.join(out, "sft")
    if os.path.exists(stop):
        return sft
    # SFT in chunks, stopping at the first held-out pass@1 (greedy) of at least --sft-stop-pass1: RL
    # needs a model that solves some tasks and fails others
    iteration, pass1 = 0, 0.0
    while iteration < args.sft_iters and pass1 < args.sft_stop_pass1:
        first, iteration = iteration == 0, min(args.sft_iters, iteration + args.sft_chunk)
        start = ["--load", os.path.abspath(args.load), "--finetune"] if first else ["--load", sft]
        sh([sys.executable, "pretrain_cpt.py", "--stage", "sft", *common_flags(args), "--data-path", data,
            "--micro-batch-size", "4", "--train-iters", str(iteration), "--lr", str(args.sft_lr),
            "--min-lr", str(args.sft_lr), "--lr-warmup-iters", "10", "--log-interval", "50", *start,
            "--save", sft], os.path.join(out, f"sft_{iteration}.log"))
        pass1 = held_out(sft, args, os.path.join(out, f"eval_sft{iteration}_greedy.log"), temperature=0.0)["solved"]
        print(f"gather SFT: iteration {iteration}, held-out pass@1 {pass1:.3f} (greedy, {args.eval_count} tasks)",
              flush=True)
    with open(stop, "w") as f:
        f.write(f"{iteration} {pass1}\n")
    return sft


def sft_result(args) -> tuple[int, float]:
    """(the SFT's last iteration, its held-out pass@1) as `gather_sft` recorded them."""
    iteration, pass1 = open(os.path.join(os.path.abspath(args.out), "sft_done.txt")).read().split()
    return int(iteration), float(pass1)


def rl_run(args, sft: str, name: str, seed: int, reward: str, lr: str, extra: tuple[str, ...] = ()) -> str:
    """One RL run from `sft` on the training tasks of `--family` (the same tasks for every name at one
    seed); `extra`: more train_rl.py flags."""
    run = os.path.join(os.path.abspath(args.out), f"{name}_seed{seed}")
    if not done(run):
        if os.path.exists(os.path.join(run, "rl_steps.jsonl")):
            os.remove(os.path.join(run, "rl_steps.jsonl"))  # an unfinished run starts over
        sh([sys.executable, "train_rl.py", "--env", "agentic-coding", "--task-families", args.family,
            *common_flags(args), "--load", sft, "--save", run, "--overwrite-save", "--save-interval", "100000",
            "--seed", str(seed), "--rl-micro-batch-tokens", "8192", "--train-iters", str(args.steps),
            "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
            "--max-new-tokens", str(args.max_new_tokens), "--max-turns", str(args.max_turns),
            "--temperature", "1.0", "--lr", lr, "--min-lr", lr, "--lr-warmup-iters", "0",
            "--log-interval", "1", "--reward", reward, "--length-penalty-weights", args.effort_weights, *extra],
           run + ".log")
    return run


def add_gather_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the SFT checkpoint and the RL runs, shared with benchmarks/rl_learns.py (the same
    `--out` reuses its checkpoint and runs)."""
    p.add_argument("--family", choices=sorted(FAMILY_DEFAULTS), default="gather",
                   help="the task family of RL and the held-out evaluation; gather: SFT on gather trajectories "
                        "from --load first; write-file: RL starts from --load itself")
    p.add_argument("--load", default=None,
                   help="gather: the checkpoint the gather SFT starts from (default runs/tiny/cpt_32k, `make demo-cpt`); "
                        "write-file: the SFT checkpoint RL starts from (default runs/tiny/agent_sft_model, "
                        "examples/tiny/agentic_rl.sh)")
    p.add_argument("--out", default=None, help="runs and checkpoints (default runs/<family>_rl)")
    p.add_argument("--tokenizer-model", default="data/tokenizer.model")
    p.add_argument("--data-cache-dir", default="data")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--reward", default="correctness=1.0,all_pass=1.0,tool_misuse=0.1")
    p.add_argument("--tasks", type=int, default=2000, help="expert gather trajectories in the SFT data")
    p.add_argument("--sequential-reads", type=float, default=0.7,
                   help="the fraction of SFT trajectories that read one file per message")
    p.add_argument("--sft-iters", type=int, default=1600, help="SFT stops here at the latest")
    p.add_argument("--sft-chunk", type=int, default=200, help="SFT steps between held-out evaluations")
    p.add_argument("--sft-stop-pass1", type=float, default=0.3,
                   help="SFT stops at the first held-out pass@1 (greedy) at least this")
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--seq-length", type=int, default=None, help="default: gather 1024, write-file 512")
    p.add_argument("--max-turns", type=int, default=None, help="default: gather 10, write-file 3")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per turn; default: gather 160 (a list of 6 reads is ~110 tokens), write-file 64")
    p.add_argument("--eval-count", type=int, default=48, help="held-out tasks")
    p.add_argument("--effort-weights", default="turns=16",
                   help="--length-penalty-weights of every run: the logged effort (and the length term where one "
                        "is rewarded); a model turn weighs 16 tokens, every token 1")


def read_steps(run: str) -> list[dict]:
    by_step = {}
    with open(os.path.join(run, "rl_steps.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            by_step[int(row["iteration"])] = row
    return [by_step[k] for k in sorted(by_step)]


def line(name: str, row: dict) -> str:
    return (f"solved {row['solved']:.3f}  turns per solved {row['turns per solved']:.2f}  "
            f"calls per turn {row['calls per turn']:.2f}  turns {row['turns']:.2f}  ({name})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gather_flags(p)
    p.add_argument("--terms", default="parallel_tool_calls=1.0,tool_efficiency=0.2",
                   help="added to --reward in the second arm")
    p.add_argument("--plot", default="docs/parallel_tools.png")
    args = parse_args(p)
    started = time.perf_counter()
    sft = gather_sft(args)
    out = os.path.abspath(args.out)
    start = held_out(sft, args, os.path.join(out, "eval_sft_sampled.log"))
    print(f"parallel_tools after SFT: {line('held-out, sampled', start)}", flush=True)

    seeds = [int(s) for s in args.seeds.split(",")]
    ends: dict[str, list[dict]] = {arm: [] for arm, _ in ARMS}
    curves: dict[str, list[list[dict]]] = {arm: [] for arm, _ in ARMS}
    for seed in seeds:
        for arm, name in ARMS:
            reward = args.reward + ("," + args.terms if name == "terms" else "")
            run = rl_run(args, sft, name, seed, reward, args.lr)
            curves[arm].append(read_steps(run))
            ends[arm].append(held_out(run, args, os.path.join(out, f"eval_{name}_seed{seed}_sampled.log")))
            print(f"parallel_tools {arm} seed {seed}: {line('held-out, sampled', ends[arm][-1])}", flush=True)

    mean = {arm: {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} for arm, rows in ends.items()}
    for arm, _ in ARMS:
        print(f"parallel_tools {arm}, mean of seeds {args.seeds}: {line('held-out, sampled', mean[arm])}")
    base, terms = mean["RL"], mean["RL + tool terms"]
    ratio = (f"{base['turns per solved'] / terms['turns per solved']:.2f}x" if base["turns per solved"] and
             terms["turns per solved"] else "n/a (an arm solved no held-out task)")
    spread = {arm: (min(r["solved"] for r in rows), max(r["solved"] for r in rows)) for arm, rows in ends.items()}
    print(f"parallel_tools: turns per solved episode, RL / RL + tool terms = {ratio} (target >= 1.5x); "
          f"solve rate {base['solved']:.3f} (seeds {spread['RL'][0]:.3f}-{spread['RL'][1]:.3f}) vs "
          f"{terms['solved']:.3f} (seeds {spread['RL + tool terms'][0]:.3f}-{spread['RL + tool terms'][1]:.3f}); "
          f"after SFT {start['turns per solved']:.2f} turns per solved, solved {start['solved']:.3f}; "
          f"{args.steps} steps of {args.prompts_per_step} x {args.group_size}, lr {args.lr}, terms {args.terms}, "
          f"{args.eval_count} held-out tasks; {time.perf_counter() - started:.0f} s")
    if args.plot:
        plot(curves, args)


def plot(curves: dict[str, list[list[dict]]], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
    panels = (("turns", "model turns per episode"), ("task all_pass", "solve rate (sampled)"))
    for ax, (key, label) in zip(axes, panels):
        for (arm, runs), color in zip(curves.items(), ("tab:gray", "tab:blue")):
            values = [[row.get(key, 0.0) for row in run] for run in runs]
            steps = list(range(1, len(values[0]) + 1))
            for v in values:
                ax.plot(steps, v, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, [sum(v[i] for v in values) / len(values) for i in range(len(steps))], color=color,
                    linewidth=2.2, label=f"{arm} (mean of {len(values)} seeds)")
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{args.family}: RL with and without {args.terms}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    print(f"parallel_tools: plot {args.plot}")


if __name__ == "__main__":
    main()
