"""MTP speculative decoding at batch 1: acceptance rate and speedup over plain decoding.

    python benchmarks/mtp_decode.py [--self-distilled runs/tiny/mtp_self-distill] [--ce runs/tiny/mtp_ce]
                                    [--prompts 8] [--prompt-len 64] [--new-tokens 64] [--repeats 3] [--threads N]

The checkpoints are the tiny demo trunk (`make demo-cpt`, runs/tiny/cpt_32k) with
its MTP layer trained on the frozen trunk by `examples/tiny/mtp_distill.sh`,
once by self-distillation toward the main head and once by cross-entropy on
the token two ahead; the trunk is the same in both.

Baseline: plain decoding (`speculative=None`) of the same engine on the same
checkpoint and prompts; ours: `speculative="mtp"` (the MTP layer drafts one
token, the trunk verifies it in a 2-token forward). Greedy speculative output
equals plain greedy output token for token (checked and printed); at
temperature 1 each emitted token is distributed as plain sampling's.

Greedy decoding of the tiny demo model soon repeats a line over and over,
which the MTP head predicts almost always, so greedy acceptance is an upper
bound; the temperature-1 acceptance is the one representative of sampled
rollouts.

Prompts are the first `--prompt-len` tokens of validation documents
(data/stdlib_valid: held-out standard-library modules), one request at a
time (batch 1), `--new-tokens` each with no stop token. Plain and
speculative runs of each checkpoint and temperature are interleaved
`--repeats` times; the speedup is the ratio of median wall-clock times for
all prompts ("cpu": of process CPU times, less sensitive to other jobs on a
shared machine). Also printed: the verification steps' mean time against a
plain decoding step's (speedup = tokens per step x plain step / spec step).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def validation_prompts(data_dir: str, count: int, length: int, min_length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` validation documents at least `min_length` long."""
    from megatron_composer.data.indexed import document_prefixes

    return document_prefixes(os.path.join(data_dir, "stdlib_valid"), count, length, min_length)


def run(engine, prompts, params) -> dict:
    """Generate for each prompt alone (batch 1); wall seconds, tokens, engine steps and spec stats."""
    tokens, steps, proposed, accepted, outputs = 0, 0, 0, 0, []
    start, cpu = time.perf_counter(), time.process_time()
    for prompt in prompts:
        before = engine.steps
        completion = engine.generate([prompt], params)[0]
        steps += engine.steps - before
        tokens += len(completion.token_ids)
        outputs.append(completion.token_ids)
        if completion.speculative is not None:
            proposed += completion.speculative.proposed
            accepted += completion.speculative.accepted
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu": cpu, "tokens": tokens, "steps": steps, "proposed": proposed,
            "accepted": accepted, "outputs": outputs}


def compare(engine, prompts, new_tokens: int, temperature: float, repeats: int) -> dict:
    """Interleaved plain / speculative runs; medians and the last runs' counts."""
    from megatron_composer.inference import SamplingParams

    kinds = {name: SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=0, speculative=spec)
             for name, spec in (("plain", None), ("mtp", "mtp"))}
    times = {name: [] for name in kinds}
    cpu = {name: [] for name in kinds}
    last = {}
    for name, params in kinds.items():  # warm-up
        run(engine, prompts[:1], params)
    for _ in range(repeats):
        for name, params in kinds.items():
            last[name] = run(engine, prompts, params)
            times[name].append(last[name]["seconds"])
            cpu[name].append(last[name]["cpu"])
    return {name: dict(last[name], seconds=statistics.median(times[name]), cpu=statistics.median(cpu[name]))
            for name in kinds}


def report(label: str, temperature: float, result: dict, prompts: int) -> str:
    plain, mtp = result["plain"], result["mtp"]
    acceptance = mtp["accepted"] / mtp["proposed"] if mtp["proposed"] else 0.0
    # engine steps per prompt: one prefill step, then one per decoding step
    plain_step = plain["seconds"] / plain["steps"]
    mtp_step = mtp["seconds"] / mtp["steps"]
    tokens_per_step = (mtp["tokens"] - prompts) / (mtp["steps"] - prompts)
    line = (f"{label:13s} T={temperature:g}: acceptance {acceptance:.3f} | tokens/s plain {plain['tokens'] / plain['seconds']:6.1f}"
            f"  mtp {mtp['tokens'] / mtp['seconds']:6.1f}  speedup {plain['seconds'] / mtp['seconds']:.2f}x "
            f"(cpu {plain['cpu'] / mtp['cpu']:.2f}x) | "
            f"step ms plain {1e3 * plain_step:5.1f}  mtp {1e3 * mtp_step:5.1f}  "
            f"(x{mtp_step / plain_step:.2f}), tokens per mtp step {tokens_per_step:.2f}")
    if temperature == 0:
        same = sum(a == b for a, b in zip(plain["outputs"], mtp["outputs"]))
        line += f" | greedy outputs equal {same}/{prompts}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-distilled", default=os.path.join(ROOT, "runs/tiny/mtp_self-distill"))
    parser.add_argument("--ce", default=os.path.join(ROOT, "runs/tiny/mtp_ce"))
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "data"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from megatron_composer.checkpoint import is_checkpoint_dir

    for flag, path in (("--self-distilled", args.self_distilled), ("--ce", args.ce)):
        if not is_checkpoint_dir(path):
            raise SystemExit(f"{flag} {path}: no checkpoint there; run `make demo-cpt` and then "
                             f"`bash examples/tiny/mtp_distill.sh {'ce' if flag == '--ce' else 'self-distill'}`")

    from megatron_composer.inference.engine import Engine

    prompts = validation_prompts(args.data_dir, args.prompts, args.prompt_len, args.prompt_len + args.new_tokens)
    print(f"MTP speculative decoding, batch 1, fp32 on CPU, {torch.get_num_threads()} threads; {args.prompts} "
          f"validation prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens, median of "
          f"{args.repeats} interleaved runs")
    print("baseline: plain decoding (speculative=None) of the same engine, checkpoint and prompts")
    max_len = args.prompt_len + args.new_tokens + 1
    for label, path in (("self-distill", args.self_distilled), ("ce", args.ce)):
        engine = Engine.from_checkpoint(path, device="cpu", dtype=torch.float32, max_model_len=max_len,
                                        max_batch_size=1)
        for temperature in args.temperatures:
            result = compare(engine, prompts, args.new_tokens, temperature, args.repeats)
            print(report(label, temperature, result, args.prompts), flush=True)


if __name__ == "__main__":
    main()
