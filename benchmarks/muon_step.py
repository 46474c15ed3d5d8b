"""Muon optimizer step time on a MoE-shaped parameter set: our sharded pipeline vs two baselines.

    python benchmarks/muon_step.py [--world 4] [--layers 1] [--steps 7] [--warmup 2] [--ns-dtype bf16]

Spawns `--world` CPU ranks over gloo (one thread each). The parameter set is
one MoE decoder layer per `--layers`: 64 experts with fc1 [256, 128] and
fc2 [128, 256], and MLA attention at hidden 512 with 16 heads (q_down,
q_up, kv_down, kv_up, linear_proj), split per head as `param_groups` does
with granularity "head". All three variants run the same Muon update
(momentum, Newton-Schulz, lr scaling, weight decay) on the same gradients:

  (a) redundant   every rank holds whole gradients and orthogonalizes every
                  block itself (no communication; `Muon` on every rank).
  (b) round-robin whole gradients; whole parameters owned round-robin
                  (sorted by size, as KellerJordan/Muon), each owner batches
                  its Newton-Schulz, then every update is all_gathered.
  ours            every parameter is dim-0 sharded over the W ranks as FSDP2
                  does; `ShardedMuon` all-to-alls blocks to balanced owners,
                  batches Newton-Schulz, all-to-alls back, overlapped.

Step time is the median over `--steps` timed steps after `--warmup`, from a
barrier before the step to a barrier after it (so: the slowest rank). The
variants' steps are interleaved so that they share any background load.
Then (`--cpt-steps`, 0 to skip) a tiny CPT comparison in this process:
the `tiny` preset trained on the embedded stdlib corpus from the same
initialization with `--optimizer adam` and `--optimizer muon` (same LR
schedule; Muon with match_rms_adamw), printing the loss of the last steps.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_composer.optim.muon import Muon, orthogonalize_local  # noqa: E402
from megatron_composer.optim.param_groups import HeadGeometry, muon_split  # noqa: E402
from megatron_composer.optim.sharded_muon import ShardedMuon, ShardLayout, chunk_range  # noqa: E402

GEOMETRY = HeadGeometry(num_heads=16, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)
HIDDEN, Q_LORA, KV_LORA = 512, 256, 128
NUM_EXPERTS, EXPERT_HIDDEN, EXPERT_FFN = 64, 128, 256


def moe_named_shapes(layers: int) -> list[tuple[str, tuple[int, int]]]:
    g, out = GEOMETRY, []
    for i in range(layers):
        attn = f"decoder.layers.{i}.self_attention."
        out += [
            (attn + "linear_q_down_proj.weight", (Q_LORA, HIDDEN)),
            (attn + "linear_q_up_proj.weight", (g.num_heads * (g.qk_head_dim + g.qk_pos_emb_head_dim), Q_LORA)),
            (attn + "linear_kv_down_proj.weight", (KV_LORA + g.qk_pos_emb_head_dim, HIDDEN)),
            (attn + "linear_kv_up_proj.weight", (g.num_heads * (g.qk_head_dim + g.v_head_dim), KV_LORA)),
            (attn + "linear_proj.weight", (HIDDEN, g.num_heads * g.v_head_dim)),
        ]
        for e in range(NUM_EXPERTS):
            expert = f"decoder.layers.{i}.mlp.experts.local_experts.{e}."
            out += [(expert + "linear_fc1.weight", (EXPERT_FFN, EXPERT_HIDDEN)),
                    (expert + "linear_fc2.weight", (EXPERT_HIDDEN, EXPERT_FFN))]
    return out


class RoundRobinMuon(Muon):
    """Baseline (b): whole parameters owned round-robin, then all_gather (KellerJordan/Muon's layout).

    As in KellerJordan/Muon, parameters are sorted by size and position j
    is owned by rank j % W; each W-chunk is all_gathered (flattened and
    padded to the chunk's largest). Unlike it, each rank batches the
    Newton-Schulz of all its parameters like ours does, so the comparison
    isolates ownership and communication, not batching.
    """

    def _orthogonalize(self, params, updates, splits, configs):
        world, rank = dist.get_world_size(), dist.get_rank()
        order = sorted(range(len(updates)), key=lambda i: (-updates[i].numel(), tuple(updates[i].shape)))
        mine = order[rank::world]
        outs = [None] * len(updates)
        for i, o in zip(mine, orthogonalize_local([updates[i] for i in mine], [splits[i] for i in mine],
                                                  [configs[i] for i in mine])):
            outs[i] = o
        works = []
        for base in range(0, len(order), world):
            chunk = order[base : base + world]
            width = max(updates[i].numel() for i in chunk)
            dtype = configs[chunk[0]].dtype
            send = torch.zeros(width, dtype=dtype)
            if rank < len(chunk):
                send[: updates[chunk[rank]].numel()] = outs[chunk[rank]].reshape(-1)
            recv = [torch.empty(width, dtype=dtype) for _ in range(world)]
            works.append((chunk, recv, dist.all_gather(recv, send, async_op=True)))
        for chunk, recv, work in works:
            work.wait()
            for i, buf in zip(chunk, recv):
                outs[i] = buf[: updates[i].numel()].view(updates[i].shape)
        return outs


def _timed_step(opt, params, grads) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    dist.barrier()
    t0 = time.perf_counter()
    opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        named = moe_named_shapes(args.layers)
        splits = [muon_split(n, s, GEOMETRY, "head")[1] for n, s in named]
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(s, generator=gen) * 0.02 for _, s in named]
        grads = [torch.randn(s, generator=gen) for _, s in named]
        kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=args.ns_dtype)

        def groups(params):
            return [{"params": [p], "split": s} for p, s in zip(params, splits)]

        def shard(t):
            lo, hi = chunk_range(t.shape[0], world, rank)
            return t[lo:hi].clone()

        variants = {}  # name -> (optimizer, params, grads)
        for name, cls in (("a", Muon), ("b", RoundRobinMuon)):
            params = [f.clone() for f in full]
            variants[name] = (cls(groups(params), **kw), params, grads)
        params = [shard(f) for f in full]
        layouts = {p: ShardLayout(tuple(f.shape), dist.group.WORLD) for p, f in zip(params, full)}
        variants["ours"] = (ShardedMuon(groups(params), shard_layouts=layouts, **kw), params, [shard(g) for g in grads])

        # Interleaved, so every variant sees the same background load on a shared machine.
        times = {name: [] for name in variants}
        for k in range(args.warmup + args.steps):
            for name, (opt, params, grads_) in variants.items():
                t = _timed_step(opt, params, grads_)
                if k >= args.warmup:
                    times[name].append(t)
        timings = {name: statistics.median(ts) for name, ts in times.items()}
        finals = {name: [shard(p) for p in params] if name != "ours" else params
                  for name, (_, params, _) in variants.items()}
        # Same gradients and steps everywhere: every variant must end at the same parameters.
        for name in ("b", "ours"):
            diff = max((x - y).abs().max().item() for x, y in zip(finals[name], finals["a"]) if x.numel())
            diff = torch.tensor(diff)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            timings[f"diff_{name}"] = diff.item()
        if rank == 0:
            results.put(timings)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ns-dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--cpt-steps", type=int, default=40)
    parser.add_argument("--data-cache-dir", default="data")
    args = parser.parse_args(argv)
    args.ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.ns_dtype]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.spawn(_worker, args=(args.world, port, args, results), nprocs=args.world, join=True)
    t = results.get()

    named = moe_named_shapes(args.layers)
    numel = sum(a * b for _, (a, b) in named)
    print(f"muon_step: world={args.world} gloo cpu, 1 thread/rank, ns_dtype={str(args.ns_dtype)[6:]}, "
          f"{args.layers} layer(s): {NUM_EXPERTS} experts x (fc1 [256,128], fc2 [128,256]) + MLA attention "
          f"hidden {HIDDEN}, {GEOMETRY.num_heads} heads, per-head splits; {len(named)} params, {numel / 1e6:.1f}M")
    print(f"(a) redundant, every rank every matrix   : {t['a'] * 1e3:8.1f} ms/step (median of {args.steps})")
    print(f"(b) round-robin owners + all_gather      : {t['b'] * 1e3:8.1f} ms/step")
    print(f"ours sharded all_to_all + batched NS     : {t['ours'] * 1e3:8.1f} ms/step")
    print(f"speedup: ours vs (a) {t['a'] / t['ours']:.2f}x, ours vs (b) {t['b'] / t['ours']:.2f}x")
    print(f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the end (other work shares the cpus)")
    print(f"check: max |param - (a)| after {args.warmup + args.steps} steps: (b) {t['diff_b']:.1e}, "
          f"ours {t['diff_ours']:.1e}")
    if args.cpt_steps:
        cpt_comparison(args.cpt_steps, args.data_cache_dir)


def cpt_comparison(steps: int, data_dir: str, seq: int = 128, lr: float = 3e-3) -> None:
    """Tiny CPT from one initialization with AdamW and with Muon + AdamW."""
    from megatron_composer.config import OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.data import CPTDataset, default_cpt_data
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.training.trainer import Trainer, TrainingData

    init_distributed()
    data = default_cpt_data(data_dir, progress=False)
    dataset = CPTDataset(data.train_prefix, seq, seed=1234)
    losses = {}
    for name, optimizer in (("adamw", "adam"), ("muon", "muon")):
        cfg = TrainingConfig(seq_length=seq, micro_batch_size=8, train_iters=steps, seed=1234,
                             optimizer=OptimizerConfig(optimizer=optimizer, lr=lr, min_lr=lr / 10,
                                                       lr_warmup_iters=steps // 10, lr_decay_iters=steps))
        trainer = Trainer(get_preset("tiny"), ParallelLayout(world_size=1), TrainingData(dataset), cfg)
        losses[name] = [trainer.step().lm_loss for _ in range(steps)]
    tail = max(steps // 10, 1)
    mean = {k: sum(v[-tail:]) / tail for k, v in losses.items()}
    print(f"cpt (tiny, seq {seq}, batch 8, lr {lr}, same init): lm loss after {steps} steps "
          f"(mean of last {tail}): adamw {mean['adamw']:.4f}, muon {mean['muon']:.4f}, "
          f"muon - adamw {mean['muon'] - mean['adamw']:+.4f}")


if __name__ == "__main__":
    main()
