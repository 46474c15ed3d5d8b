"""Train-vs-rollout log-prob mismatch with and without router replay.

    python benchmarks/router_replay.py [--load runs/tiny/sft] [--samples 64] [--threshold 0.5]

The rollout engine runs the model in bf16 (as inference does on GPUs); the
trainer recomputes the same tokens' log-probs in fp32. Their gap on the
generated tokens, mean and p99 of |logp_train - logp_rollout|, is printed for:

* no replay: the fp32 routers route for themselves (bf16 rounding flips
  near-tied experts, and every flip changes the token's whole MoE output);
* replay: the engine's experts are forced (`moe.replay`, threshold 0);
* replay + filter: replayed experts whose gate is below `--threshold` x the
  router's own k-th gate are replaced, with the fraction replaced.

The baseline is "no replay". Without `--load`, the tiny preset at random
initialization (expert choices are then close to ties, the hardest case).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_composer.config import get_preset  # noqa: E402
from megatron_composer.inference import SamplingParams  # noqa: E402
from megatron_composer.inference.engine import Engine  # noqa: E402
from megatron_composer.models import build_model, composer_forward  # noqa: E402
from megatron_composer.moe.replay import RouterReplayController  # noqa: E402
from megatron_composer.parallel import ParallelLayout  # noqa: E402
from megatron_composer.parallel.layout import initialize_parallel  # noqa: E402
from megatron_composer.platform import init_distributed  # noqa: E402


def _models(load):
    init_distributed()
    initialize_parallel(ParallelLayout(world_size=1), seed=1234)
    if load:
        from megatron_composer.models import load_checkpoint_model

        model, cfg = load_checkpoint_model(load, seq_length=512)
    else:
        cfg = get_preset("tiny")
        model = build_model(cfg, ParallelLayout(world_size=1), seq_length=512).eval()
    rollout = build_model(cfg, ParallelLayout(world_size=1), seq_length=512).eval()
    rollout.load_state_dict(model.state_dict())
    return model.eval(), rollout.to(torch.bfloat16), cfg


def _gaps(model, outs, controller):
    gaps = []
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        if controller is not None:
            controller.set(out.routed_experts)
        with torch.no_grad():
            logits, _ = composer_forward(model, torch.tensor([tokens]), torch.arange(len(tokens))[None])
        logp = torch.log_softmax(logits[0].float(), -1)[len(out.prompt_token_ids) - 1:-1]
        train = logp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        gaps.append((train - torch.tensor(out.logprobs)).abs())
    if controller is not None:
        controller.clear()
    return torch.cat(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", default=None, help="a checkpoint (default: tiny preset, random weights)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.5)
    args = parser.parse_args()
    model, rollout, cfg = _models(args.load)
    engine = Engine(rollout, cfg, max_batch_size=args.samples, max_model_len=args.prompt_length + args.new_tokens + 1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (args.prompt_length,), generator=g).tolist()
               for _ in range(args.samples)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0, logprobs=True,
                                                   return_routed_experts=True))
    print(f"rollout bf16, training fp32; {args.samples} samples x {args.new_tokens} tokens "
          f"({'random tiny' if not args.load else args.load})")
    print(f"{'routing':<22} {'mismatch mean':>14} {'p99':>10} {'replaced':>9}")
    base = _gaps(model, outs, None)
    rows = [("no replay (baseline)", base, None)]
    replay = RouterReplayController(model, 0.0)
    rows.append(("replay", _gaps(model, outs, replay), replay.replaced_fraction()))
    filtered = RouterReplayController(model, args.threshold)
    rows.append((f"replay + filter {args.threshold:g}", _gaps(model, outs, filtered), filtered.replaced_fraction()))
    for name, gap, replaced in rows:
        p99 = float(torch.quantile(gap, 0.99))
        ratio = float(base.mean()) / max(float(gap.mean()), 1e-12)
        print(f"{name:<22} {float(gap.mean()):>14.3e} {p99:>10.3e} "
              f"{'' if replaced is None else f'{replaced:.4f}':>9}  baseline / this: {ratio:.2f}x")


if __name__ == "__main__":
    main()
