"""Context-parallel MLA attention: load balance and communication, side by side.

    python benchmarks/cp_attention.py            # all three, ~1-2 minutes on 2 cores
    python benchmarks/cp_attention.py --skip-timing

(a) Per-rank causal attention work (query-key pairs under the causal mask),
    max/mean over CP ranks, zigzag split (rank i: chunks i and 2CP-1-i) vs the
    contiguous split, CP = 2, 4, 8 at 256K tokens. Target: zigzag <= 1.01 at CP=8.
(b) Bytes each rank receives per layer and sequence for K/V, bf16, kimi-k2.5
    shape (`config.get_preset("kimi-k2.5")`): the latent all-gather (kv_lora_rank
    + qk_pos_emb_head_dim per token) vs a ring (or all-gather) of expanded
    per-head K/V (heads x (qk + rope + v) per token), as megatron-core/TE CP
    moves for MLA. Backward doubles both (reduce-scatter of latent gradients;
    dK/dV ring). Target: latent <= 5% of expanded.
(c) Measured per-rank attention time on CPU over gloo at sequence 4096: each
    rank all-gathers latents (`attention.cp.latent_all_gather`), up-projects
    K/V for the full sequence and runs `attention.cp.attend_segments` forward
    and backward for its queries; ranks are timed one at a time (the machine
    may have fewer cores than ranks), best of --repeats (other load on the
    machine only ever adds time), reported max/mean.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_composer.config import get_preset  # noqa: E402
from megatron_composer.parallel import ZigzagLayout  # noqa: E402

SEQ_256K = 262144


def balance(layout_of, cp: int) -> float:
    work = [layout_of(cp).causal_work(r) for r in range(cp)]
    return max(work) / (sum(work) / cp)


def work_table(cps=(2, 4, 8), seq=SEQ_256K) -> list[str]:
    lines = [f"(a) causal attention work per rank at seq {seq}, max/mean over CP ranks"]
    zig8 = None
    for cp in cps:
        zig = balance(lambda c: ZigzagLayout((seq,), c), cp)
        naive = balance(lambda c: ZigzagLayout((seq,), c, "contiguous"), cp)
        zig8 = zig if cp == 8 else zig8
        lines.append(f"    CP={cp}: zigzag {zig:.4f}   contiguous {naive:.4f}")
    if zig8 is not None:
        lines.append(f"    target zigzag max/mean <= 1.01 at CP=8: {zig8:.4f} "
                     f"{'PASS' if zig8 <= 1.01 else 'FAIL'}")
    return lines


def kv_bytes_table(cps=(2, 4, 8), seq=SEQ_256K, preset="kimi-k2.5", dtype_bytes=2) -> list[str]:
    cfg = get_preset(preset)
    latent = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    expanded = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim)
    lines = [f"(b) K/V bytes received per rank per layer, {preset} (heads={cfg.num_attention_heads}, "
             f"kv_lora={cfg.kv_lora_rank}, rope={cfg.qk_pos_emb_head_dim}, qk={cfg.qk_head_dim}, "
             f"v={cfg.v_head_dim}), seq {seq}, bf16, forward"]
    for cp in cps:
        remote = seq * (cp - 1) // cp  # tokens held by the other ranks
        a, b = remote * latent * dtype_bytes, remote * expanded * dtype_bytes
        lines.append(f"    CP={cp}: latent all-gather {a / 2**20:9.1f} MiB   expanded K/V ring "
                     f"{b / 2**20:9.1f} MiB   latent/expanded {100 * a / b:.2f}%")
    ratio = latent / expanded
    lines.append(f"    per token: {latent} vs {expanded} numbers; target latent <= 5% of expanded: "
                 f"{100 * ratio:.2f}% {'PASS' if ratio <= 0.05 else 'FAIL'}")
    return lines


def _timing_body(rank, world, seq, heads, qk, rope, v, kv_lora, repeats):
    import torch.distributed as dist

    from megatron_composer.attention.cp import attend_segments, latent_all_gather

    torch.manual_seed(0)
    scale = (qk + rope) ** -0.5
    up = torch.nn.Linear(kv_lora, heads * (qk + v), bias=False)
    results = {}
    for scheme in ("zigzag", "contiguous"):
        layout = ZigzagLayout((seq,), world, scheme)
        latent = torch.randn(layout.local_length, 1, kv_lora + rope, requires_grad=True)
        full = latent_all_gather(latent, None).wait().index_select(0, layout.unzigzag_index())
        kv_c, k_rope = full.split([kv_lora, rope], dim=-1)
        kv = up(kv_c).view(seq, 1, heads, qk + v)
        k_nope, value = kv.split([qk, v], dim=-1)
        key = torch.cat([k_nope, k_rope.unsqueeze(-2).expand(seq, 1, heads, rope)], dim=-1)
        key, value = key.detach().requires_grad_(), value.detach().requires_grad_()
        query = torch.randn(layout.local_length, 1, heads, qk + rope, requires_grad=True)
        segments = layout.query_segments(rank)
        times = []
        for _ in range(repeats):
            for turn in range(world):  # one rank computes at a time
                dist.barrier()
                if turn == rank:
                    start = time.perf_counter()
                    out = attend_segments(query, key, value, segments, scale, packed=False)
                    out.sum().backward()
                    times.append(time.perf_counter() - start)
            dist.barrier()
        results[scheme] = min(times)
    return results


def timing_table(cps=(2, 4), seq=4096, heads=8, repeats=5) -> list[str]:
    from tests.distributed import run_distributed

    tiny = get_preset("tiny")
    dims = (tiny.qk_head_dim, tiny.qk_pos_emb_head_dim, tiny.v_head_dim, tiny.kv_lora_rank)
    lines = [f"(c) measured attention fwd+bwd per rank on CPU (gloo), seq {seq}, {heads} heads, "
             f"qk={dims[0]} rope={dims[1]} v={dims[2]}; best of {repeats}"]
    for cp in cps:
        res = run_distributed(_timing_body, cp, seq, heads, *dims, repeats)
        row = []
        for scheme in ("zigzag", "contiguous"):
            t = [r[scheme] for r in res]
            row.append(f"{scheme} max/mean {max(t) / statistics.mean(t):.3f} "
                       f"(ms per rank: {', '.join(f'{1000 * x:.0f}' for x in t)})")
        lines.append(f"    CP={cp}: " + "   ".join(row))
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-timing", action="store_true", help="only (a) and (b), no processes")
    p.add_argument("--timing-cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--timing-seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    lines = work_table() + kv_bytes_table()
    for line in lines:
        print(line, flush=True)
    if not args.skip_timing:
        for line in timing_table(args.timing_cp, args.timing_seq, args.heads, args.repeats):
            print(line, flush=True)


if __name__ == "__main__":
    main()
