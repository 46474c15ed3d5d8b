"""Textual feedback vs RL alone: how fast a targeted tool mistake disappears.

    python benchmarks/textual_feedback.py --load runs/tiny/agent_sft_model [--seeds 1,2,3] [--steps 20]

1. Mistake SFT data: expert write-file trajectories (`rl.sft_trajectories`),
   of which `--mistake-fraction` first call the tool `create_file`, which is
   not offered, get the environment's real error and then call write_file;
   `--hinted-fraction` carry the `unknown_tool` rule's note before the first
   message and call write_file at once; the rest are clean. A large model
   follows a note in its context out of the box; the tiny one learns it here,
   and it must also learn to keep copying the file name and content across
   the note: a teacher that copies worse than the student would teach those
   tokens wrong (the KL of the whole message is distilled, not just the name).
2. SFT from `--load` (an agentic SFT checkpoint, e.g. `examples/tiny/agentic_rl.sh`'s).
3. RL from that checkpoint, the same seeds and tasks for both arms: the
   baseline with `--feedback-rules unknown_tool --feedback-coef 0` (the rule
   only counts the mistakes) and the feedback run with `--feedback-coef C`.
   Reward: correctness + all_pass + 0.1 x tool misuse for both.
4. The mistake rate is unknown-tool hints per sampled trajectory, each step
   (`rl_steps.jsonl`), mean over seeds. Prints both curves, the steps until
   the rate halves and until it is below a tenth, the mistakes left after
   step 1 (the curve's sum over the later steps; step 1 samples the same
   policy in both arms) and their ratio, and P(create_file) as the first call
   on held-out tasks after SFT and after RL; plots `docs/textual_feedback.png`.
The mistake SFT data comes from training tasks after `--task-offset`, so
the tasks RL meets first carry no memorized mistake. Steps already done
(data, SFT, finished runs) are skipped when rerun with the same `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_composer.data.tool_calls import format_tool_call  # noqa: E402
from megatron_composer.rl.feedback import unknown_tool_hint  # noqa: E402
from megatron_composer.rl.tools import TOOLS, ToolSet  # noqa: E402

WRONG_TOOL = "create_file"
RATE = "feedback unknown_tool per trajectory"


def mistake_mixture(expert_lines: list[str], mistake: float, hinted: float, seed: int) -> list[str]:
    """Expert write-file conversations, a `mistake` fraction with a call to WRONG_TOOL first and a
    `hinted` fraction with the unknown_tool note before the first message."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = []
        for line in expert_lines:
            record = json.loads(line)
            messages = record["messages"]
            first = messages[2]  # system, user (the task), the first assistant message
            draw = rng.random()
            if draw < mistake:
                arguments = json.loads(first["content"].split("<tool_call>", 1)[1].rsplit("</tool_call>", 1)[0])
                wrong = format_tool_call(WRONG_TOOL, arguments["arguments"])
                answer = ToolSet(tmp).respond(wrong).observation  # what the environment says, exactly
                messages[2:2] = [{"role": "assistant", "content": wrong}, {"role": "user", "content": answer}]
            elif draw < mistake + hinted:
                messages.insert(2, {"role": "user", "content": unknown_tool_hint([WRONG_TOOL], tuple(TOOLS))})
            out.append(json.dumps(record, ensure_ascii=False))
    return out


def mistake_probability(checkpoint: str, tokenizer_model: str, count: int) -> float:
    """Mean over `count` held-out write-file tasks of the model's P(WRONG_TOOL | WRONG_TOOL or
    write_file) as the first call's name: the habit itself, without sampling noise."""
    import math

    import torch

    from megatron_composer.checkpoint import load_checkpoint
    from megatron_composer.checkpoint.tracker import latest_iteration
    from megatron_composer.config import get_preset
    from megatron_composer.data.sft import render_chat
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.models import build_model, composer_forward
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.agent import system_prompt
    from megatron_composer.rl.tasks.coding import load_tasks

    init_distributed()
    tok, cfg = Tokenizer(tokenizer_model), get_preset("tiny")
    layout = ParallelLayout(world_size=1, num_experts=cfg.num_experts)
    initialize_parallel(layout, 1)
    model = build_model(cfg, layout, seq_length=512)
    load_checkpoint(checkpoint, model, iteration=latest_iteration(checkpoint), allow_missing=("mtp.",))
    model.eval()

    def logp(context: list[int], text: str) -> float:
        cont = tok.encode(text)
        ids = context + cont
        with torch.no_grad():
            logits, _ = composer_forward(model, torch.tensor(ids)[None], torch.arange(len(ids))[None])
        lp = torch.log_softmax(logits[0].float(), -1)
        return sum(lp[len(context) - 1 + j, t].item() for j, t in enumerate(cont))

    total = 0.0
    tasks = load_tasks(["write-file"], "eval", count=count)
    for task in tasks:
        context = render_chat([{"role": "system", "content": system_prompt()},
                               {"role": "user", "content": task.instruction}], tok, add_generation_prompt=True)[0]
        gap = logp(context, '<tool_call>{"name": "write_file"') - logp(context, f'<tool_call>{{"name": "{WRONG_TOOL}"')
        total += 1 / (1 + math.exp(min(gap, 700)))
    return total / len(tasks)


def sh(argv: list[str], log: str) -> None:
    print("$ " + " ".join(argv[:4]) + " ...  (log: " + log + ")", flush=True)
    with open(log, "w") as f:
        code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if code:
        tail = open(log).read()[-2000:]
        raise SystemExit(f"command failed ({code}), see {log}:\n{tail}")


def done(path: str) -> bool:
    from megatron_composer.checkpoint import is_checkpoint_dir

    return is_checkpoint_dir(path)


def read_rates(run: str) -> list[float]:
    by_step = {}
    with open(os.path.join(run, "rl_steps.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            by_step[int(row["iteration"])] = row[RATE]
    return [by_step[k] for k in sorted(by_step)]


def first_step_below(curve: list[float], fraction: float) -> str:
    """The middle step of the first 3-step window whose mean is at most `fraction` of steps 1-3's."""
    start = sum(curve[:3]) / 3
    for i in range(len(curve) - 2):
        if sum(curve[i:i + 3]) / 3 <= fraction * start:
            return str(i + 2)
    return f"> {len(curve)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", default="runs/tiny/agent_sft_model", help="an agentic SFT checkpoint")
    p.add_argument("--out", default="runs/textual_feedback")
    p.add_argument("--tokenizer-model", default="data/tokenizer.model")
    p.add_argument("--data-cache-dir", default="data")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--coef", type=float, default=1.0, help="--feedback-coef of the feedback arm")
    p.add_argument("--lr", default="1e-4")
    p.add_argument("--reward", default="correctness=1.0,all_pass=1.0,tool_misuse=0.1")
    p.add_argument("--tasks", type=int, default=800, help="expert trajectories in the mistake SFT data")
    p.add_argument("--task-offset", type=int, default=400,
                   help="the mistake SFT data starts at this training task: RL's tasks (the first "
                        "prompts-per-step x steps) are not among them, so no task's mistake is memorized")
    p.add_argument("--mistake-fraction", type=float, default=0.4)
    p.add_argument("--hinted-fraction", type=float, default=0.4)
    p.add_argument("--sft-iters", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=5e-4,
                   help="low enough to keep the checkpoint's skill while it picks up the mistake")
    p.add_argument("--probe-tasks", type=int, default=48,
                   help="held-out tasks on which P(wrong tool) is measured after SFT and after RL (0: skip)")
    p.add_argument("--plot", default="docs/textual_feedback.png")
    args = p.parse_args()
    if args.prompts_per_step * args.steps > args.task_offset:
        raise SystemExit(f"RL would reach task {args.prompts_per_step * args.steps}, inside the mistake SFT data "
                         f"(from task {args.task_offset}); raise --task-offset")
    py, out = sys.executable, os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    common = ["--model-preset", "tiny", "--tokenizer-model", args.tokenizer_model,
              "--data-cache-dir", args.data_cache_dir, "--seq-length", "512"]

    mix = os.path.join(out, "mistakes.jsonl")
    if not os.path.exists(mix):
        from megatron_composer.rl.sft_trajectories import write_sft_jsonl
        from megatron_composer.rl.tasks.coding import load_tasks

        expert = os.path.join(out, "expert.jsonl")
        if not os.path.exists(expert):
            tasks = load_tasks(["write-file"], "train", count=args.task_offset + args.tasks)
            write_sft_jsonl(expert, tasks[args.task_offset:], workers=8)
        lines = open(expert).read().splitlines()[:args.tasks]
        with open(mix + ".tmp", "w") as f:
            f.write("\n".join(mistake_mixture(lines, args.mistake_fraction, args.hinted_fraction, 0)) + "\n")
        os.replace(mix + ".tmp", mix)
    sft = os.path.join(out, "sft")
    if not done(sft):
        sh([py, "pretrain_cpt.py", "--stage", "sft", *common, "--data-path", mix, "--micro-batch-size", "8",
            "--train-iters", str(args.sft_iters), "--lr", str(args.sft_lr), "--min-lr", str(args.sft_lr / 10),
            "--lr-warmup-iters", "10",
            "--log-interval", "50", "--load", os.path.abspath(args.load), "--finetune", "--save", sft],
           os.path.join(out, "sft.log"))

    seeds = [int(s) for s in args.seeds.split(",")]
    curves: dict[str, list[list[float]]] = {"RL alone": [], "RL + feedback": []}
    for seed in seeds:
        for arm, coef in (("RL alone", 0.0), ("RL + feedback", args.coef)):
            run = os.path.join(out, f"{'feedback' if coef else 'baseline'}_seed{seed}")
            if not done(run):
                if os.path.exists(os.path.join(run, "rl_steps.jsonl")):
                    os.remove(os.path.join(run, "rl_steps.jsonl"))  # an unfinished run starts over
                sh([py, "train_rl.py", "--env", "agentic-coding", "--task-families", "write-file", *common,
                    "--load", sft, "--save", run, "--save-interval", "100000", "--seed", str(seed),
                    "--rl-micro-batch-tokens", "4096", "--train-iters", str(args.steps),
                    "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
                    "--max-new-tokens", "64", "--max-turns", "4", "--temperature", "1.0",
                    "--lr", args.lr, "--min-lr", args.lr, "--lr-warmup-iters", "0", "--log-interval", "1",
                    "--reward", args.reward,
                    "--feedback-rules", "unknown_tool", "--feedback-coef", str(coef)],
                   os.path.join(out, f"{os.path.basename(run)}.log"))
            curves[arm].append(read_rates(run))

    mean = {arm: [sum(c[i] for c in runs) / len(runs) for i in range(args.steps)] for arm, runs in curves.items()}
    areas = {}
    for arm, curve in mean.items():
        first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
        areas[arm] = sum(curve[1:])  # step 1 is the same policy in both arms
        print(f"textual_feedback {arm}: unknown-tool calls per trajectory, mean of seeds {args.seeds}, "
              f"steps 1-{args.steps}: " + " ".join(f"{x:.3f}" for x in curve))
        print(f"textual_feedback {arm}: steps 1-3 {first:.3f} -> steps {args.steps - 2}-{args.steps} {last:.3f}; "
              f"halved by step {first_step_below(curve, 0.5)}, below a tenth by step {first_step_below(curve, 0.1)}; "
              f"mistakes left after step 1 (sum of the curve over steps 2-{args.steps}): {areas[arm]:.3f}")
    if args.probe_tasks:
        start = mistake_probability(sft, args.tokenizer_model, args.probe_tasks)
        for arm, prefix in (("RL alone", "baseline"), ("RL + feedback", "feedback")):
            ends = [mistake_probability(os.path.join(out, f"{prefix}_seed{seed}"), args.tokenizer_model,
                                        args.probe_tasks) for seed in seeds]
            print(f"textual_feedback {arm}: P({WRONG_TOOL}) as the first call on {args.probe_tasks} held-out "
                  f"tasks: {start:.3f} after SFT -> " + " / ".join(f"{x:.4f}" for x in ends)
                  + f" after {args.steps} steps (seeds {args.seeds})")
    base, fb = areas["RL alone"], areas["RL + feedback"]
    ratio = base / fb if fb > 0 else float("inf")
    print(f"textual_feedback: RL alone leaves {ratio:.2f}x the mistakes RL + feedback leaves over steps "
          f"2-{args.steps} (coef {args.coef:g}, lr {args.lr}, {args.prompts_per_step} x {args.group_size} per step, "
          f"{len(seeds)} seeds)")
    if args.plot:
        plot(curves, mean, args)


def plot(curves, mean, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    steps = list(range(1, args.steps + 1))
    for (arm, runs), color in zip(curves.items(), ("tab:gray", "tab:blue")):
        for curve in runs:
            ax.plot(steps, curve, color=color, alpha=0.25, linewidth=1)
        ax.plot(steps, mean[arm], color=color, linewidth=2.2, label=f"{arm} (mean of {len(runs)} seeds)")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"calls to '{WRONG_TOOL}' per trajectory")
    ax.set_title(f"Unknown-tool mistakes: RL alone vs RL + textual feedback (coef {args.coef:g})", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    print(f"textual_feedback: plot {args.plot}")


if __name__ == "__main__":
    main()
