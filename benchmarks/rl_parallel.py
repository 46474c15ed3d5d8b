"""Memory per rank and step time of the RL step at EP=1/2/4 (gloo), and the log-prob peak chunked vs not.

    python benchmarks/rl_parallel.py [--quick] [--eps 1,2,4] [--steps 3] [--tokens 4096]

1. One RL step (`RLTrainer.train_on`) on the same hand-made samples (tests/test_rl_parallel.py's: 2
   groups x 4, uneven lengths, recorded routes, two PPO mini-batches, k1 KL to a reference model) at
   EP = 1, 2, 4 on as many gloo ranks (data-parallel over the dense weights, the experts split over EP):
   the same global batch at each. The model is the tiny preset with 16 experts of width 256, so that the
   routed experts hold most of the parameters. Per rank, exact from the tensors: parameter, gradient
   and optimizer-state bytes, the routed experts' share of the parameters (which falls as 1/EP), the
   reference model's bytes; and the process's peak resident set (`resource.getrusage`, which includes
   torch's own ~0.4 GB and the forkserver's imports, so it falls less than the tensors do). Step time:
   the median of `--steps` steps after one warm-up step (every rank shares the machine's cores: on a
   small CPU more ranks are slower, not faster).
2. The log-prob peak at vocabulary 32K: `benchmarks/rl_logprobs_memory.py`'s policy loss, chunked vs the
   unchunked formulas, over `--tokens` positions (its measurement, imported).

Prints one line per layout, the ratios to EP=1 side by side, and the log-prob lines.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from tests.distributed import run_distributed  # noqa: E402

NUM_EXPERTS, MOE_FFN = 16, 256
MIB = 2 ** 20


def _bytes(tensors) -> int:
    local = (getattr(t, "_local_tensor", t) for t in tensors if torch.is_tensor(t))
    return sum(t.numel() * t.element_size() for t in local)


def _rank(rank, world, tokenizer_model, ep, steps):
    """{name: value} of one rank: tensor bytes after the first step, peak RSS, the step times."""
    import resource

    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data.tokenizer import Tokenizer
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.rl.config import RLConfig
    from megatron_composer.rl.trainer import RLTrainer
    from tests.test_rl_parallel import GROUP_SIZE, GROUPS, _samples

    init_distributed()
    model_cfg = get_preset("tiny").replace(num_experts=NUM_EXPERTS, moe_ffn_hidden_size=MOE_FFN,
                                           max_position_embeddings=256)
    cfg = TrainingConfig(seq_length=256, micro_batch_size=1, train_iters=steps + 1, stage="rl",
                         optimizer=OptimizerConfig(lr=1e-4, lr_warmup_iters=0, lr_decay_iters=steps + 1))
    rl = RLConfig.from_flat(prompts_per_step=GROUPS, group_size=GROUP_SIZE, max_new_tokens=32, kl_coef=0.05,
                            ppo_mini_batches=2, micro_batch_tokens=128)
    layout = ParallelLayout(world_size=world, ep=ep, num_experts=NUM_EXPERTS)
    trainer = RLTrainer(model_cfg, layout, cfg, rl, Tokenizer(tokenizer_model))
    trainer.resume()
    samples = _samples(len(trainer.replay.replays), NUM_EXPERTS, model_cfg.moe_router_topk)
    times = []
    for step in range(steps + 1):  # the first is the warm-up
        start = time.perf_counter()
        trainer.train_on(samples)
        times.append(time.perf_counter() - start)
    gpt = trainer.model.gpt
    optimizer_state = [v for o in trainer.optimizer.optimizers for s in o.state.values() for v in s.values()]
    return {"parameters": _bytes(gpt.parameters()),
            "experts": _bytes(p for n, p in gpt.named_parameters() if ".experts." in n),
            "gradients": _bytes(trainer.model.grads()), "optimizer": _bytes(optimizer_state),
            "reference": trainer.reference.local_bytes(),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step": statistics.median(times[1:])}


def rl_step_memory(eps, steps) -> dict:
    """{EP: rank 0's numbers, with "ranks"} of the RL step at each EP."""
    from megatron_composer.data import default_cpt_data

    tokenizer_model = str(default_cpt_data("data", progress=False).tokenizer_model)  # the tiny preset's
    out = {}
    for ep in eps:
        results = run_distributed(_rank, ep, tokenizer_model, ep, steps, timeout=600)
        out[ep] = dict(results[0], ranks=ep, step=max(r["step"] for r in results))
    return out


def print_rl_step(results) -> None:
    base = results[min(results)]
    print(f"RL step, tiny preset with {NUM_EXPERTS} experts of width {MOE_FFN}, same 8 samples, gloo; "
          "per rank (rank 0), MiB:")
    for ep, r in results.items():
        states = r["parameters"] + r["gradients"] + r["optimizer"]
        print(f"EP={ep} ranks={r['ranks']}  params {r['parameters'] / MIB:6.2f} (experts {r['experts'] / MIB:6.2f})"
              f"  grads {r['gradients'] / MIB:6.2f}  optimizer {r['optimizer'] / MIB:6.2f}"
              f"  reference {r['reference'] / MIB:6.2f}  states+reference {(states + r['reference']) / MIB:6.2f}"
              f"  peak RSS {r['rss'] / MIB:7.1f}  step {r['step']:6.2f} s")
    for ep, r in results.items():
        if r is base:
            continue
        ratio = lambda key: r[key] / base[key]  # noqa: E731
        states = lambda x: x["parameters"] + x["gradients"] + x["optimizer"] + x["reference"]  # noqa: E731
        print(f"EP={ep}/EP={min(results)}: experts {ratio('experts'):.3f} (1/EP = {1 / ep:.3f})  "
              f"params {ratio('parameters'):.3f}  states+reference {states(r) / states(base):.3f}  "
              f"peak RSS {ratio('rss'):.3f}  step {ratio('step'):.2f}")


def logprob_memory(tokens: int, vocab: int = 32768) -> None:
    """The policy loss's peak beyond the logits, chunked vs unchunked (`rl_logprobs_memory.measure`)."""
    import rl_logprobs_memory as lp
    from megatron_composer.rl.config import RLConfig

    device = torch.device("cpu")
    rl = RLConfig.from_flat(temperature=lp.TEMPERATURE, tis_cap=2.0, kl_coef=0.05, kl_placement="loss",
                            kl_kind="k1")
    hidden, weight, batch = lp.make_inputs(tokens, vocab, torch.bfloat16, device)
    peaks = {}
    for variant, fn in (("unchunked", lp.policy_unchunked(batch, rl)), ("chunked", lp.policy_chunked(batch, rl))):
        hidden.grad = weight.grad = None
        peaks[variant], _ = lp.measure(fn, hidden, weight, device)
    print(f"log-probs T={tokens} V={vocab} (bf16 logits, CPU): peak beyond the logits unchunked "
          f"{peaks['unchunked'] / MIB:.1f} MiB, chunked {peaks['chunked'] / MIB:.1f} MiB, "
          f"ratio {peaks['unchunked'] / max(peaks['chunked'], 1):.1f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a CPU smoke: EP=1,2, one timed step, 1024 tokens")
    ap.add_argument("--eps", default=None, help="comma list of EP sizes (default 1,2,4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up (default 3)")
    ap.add_argument("--tokens", type=int, default=None, help="log-prob positions (default 4096)")
    args = ap.parse_args()
    eps = [int(e) for e in (args.eps or ("1,2" if args.quick else "1,2,4")).split(",")]
    bad = [e for e in eps if e < 1 or NUM_EXPERTS % e]
    if bad:
        raise SystemExit(f"--eps {bad[0]}: EP must divide the {NUM_EXPERTS} experts")
    steps = args.steps or (1 if args.quick else 3)
    print_rl_step(rl_step_memory(eps, steps))
    logprob_memory(args.tokens or (1024 if args.quick else 4096))


if __name__ == "__main__":
    main()
