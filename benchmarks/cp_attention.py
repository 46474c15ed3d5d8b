"""Context-parallel MLA attention: load balance and communication, side by side.

    python benchmarks/cp_attention.py            # all three, about a minute on 2 idle cores
    python benchmarks/cp_attention.py --skip-timing

(a) analytic: per-rank causal attention work (query-key pairs under the
    causal mask), max/mean over CP ranks, zigzag split (rank i: chunks i and
    2CP-1-i) vs the contiguous split, CP = 2, 4, 8 at 256K tokens. Target:
    zigzag <= 1.01 at CP=8.
(b) analytic: bytes each rank receives per layer and sequence for K/V, bf16,
    kimi-k2.5 shape (`config.get_preset("kimi-k2.5")`): the latent all-gather
    (kv_lora_rank + qk_pos_emb_head_dim per token) vs a ring (or all-gather)
    of expanded per-head K/V (heads x (qk + rope + v) per token), as
    megatron-core/TE CP moves for MLA. Backward doubles both (reduce-scatter
    of latent gradients; dK/dV ring). Target: latent <= 5% of expanded.
(c) measured, CPU gloo, CP = 2 and 4 in one run, zigzag split: the
    communication and attention of `attention/cp.py` (steps 2, 4 and 5 of its
    workflow), forward and backward, against an expanded-K/V baseline:
      latent:   `latent_all_gather` of each rank's [s/cp, kv_lora + rope]
                latents (backward: its reduce-scatter of the latent
                gradients), un-zigzag, K/V up-projection of the whole
                sequence, `attend_segments` for the local queries;
      expanded: each rank up-projects its own tokens' K/V per head, all-gathers
                the expanded K [s/cp, heads, qk + rope] and V [s/cp, heads, v]
                (backward: reduce-scatters dK and dV), un-zigzags,
                `attend_segments`.
    Bytes are what the collectives are handed: every all-gather and
    reduce-scatter call is counted through the names `attention/cp.py` and
    `parallel/collectives.py` call, per rank (all-gather: output minus the
    rank's own input; reduce-scatter: input minus the rank's own output,
    i.e. what a ring moves), forward plus backward. Time is the wall time of
    one forward + backward on all ranks at once (slowest rank, best of
    --repeats; other load on the machine only ever adds time). Both schemes
    must give the same attention output and the same latent, query and
    (summed over ranks) up-projection gradients (allclose), or the run fails.
    The up-projection is a plain weight standing in for `linear_kv_up_proj`;
    queries are inputs (their projection is the same in both schemes). On a
    machine with fewer cores than ranks the ranks share cores, which
    lengthens both schemes alike.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_composer.attention import cp as cp_attention  # noqa: E402
from megatron_composer.config import get_preset  # noqa: E402
from megatron_composer.parallel import ZigzagLayout, collectives  # noqa: E402

SEQ_256K = 262144


def balance(layout_of, cp: int) -> float:
    work = [layout_of(cp).causal_work(r) for r in range(cp)]
    return max(work) / (sum(work) / cp)


def work_table(cps=(2, 4, 8), seq=SEQ_256K) -> list[str]:
    lines = [f"(a) analytic: causal attention work per rank at seq {seq}, max/mean over CP ranks"]
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
    lines = [f"(b) analytic: K/V bytes received per rank per layer, {preset} (heads={cfg.num_attention_heads}, "
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


# ------------------------------------------------------------ (c) measured


class _ExpandedAllGather(torch.autograd.Function):
    """The baseline's exchange: all-gather expanded K (or V) forward, reduce-scatter its gradient backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        """local [s_local, b, n, d] -> [cp * s_local, b, n, d] rank-major."""
        ctx.group = group
        out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
        collectives.all_gather_single(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return cp_attention.reduce_scatter_sum(grad, ctx.group), None


def _up_project(latent, up_weight, heads, qk, rope, v):
    """Per-head K/V from latents, as `ContextParallelMLASelfAttention` step 4 does.

    Args:
        latent: [t, b, kv_lora + rope] (compressed kv, then the shared rope key).
        up_weight: [heads * (qk + v), kv_lora].
    Returns:
        key [t, b, heads, qk + rope], value [t, b, heads, v].
    """
    kv_c, k_rope = latent.split([up_weight.shape[1], rope], dim=-1)
    kv = (kv_c @ up_weight.t()).view(*kv_c.shape[:-1], heads, qk + v)
    k_nope, value = kv.split([qk, v], dim=-1)
    key = torch.cat([k_nope, k_rope.unsqueeze(-2).expand(*k_nope.shape[:-1], rope)], dim=-1)
    return key, value


def latent_scheme(latent, query, up_weight, layout, rank, dims, group=None):
    """attention/cp.py: gather latents, un-zigzag, up-project the whole sequence, attend.

    Args:
        latent: [s_local, b, kv_lora + rope]; query: [s_local, b, heads, qk + rope].
    Returns:
        [s_local, b, heads * v].
    """
    heads, qk, rope, v = dims
    full = cp_attention.latent_all_gather(latent, group).wait().index_select(0, layout.unzigzag_index())
    key, value = _up_project(full, up_weight, heads, qk, rope, v)
    return cp_attention.attend_segments(query, key.contiguous(), value.contiguous(),
                                        layout.query_segments(rank), (qk + rope) ** -0.5, packed=False)


def expanded_scheme(latent, query, up_weight, layout, rank, dims, group=None):
    """Baseline: up-project the local tokens, all-gather expanded K and V, un-zigzag, attend.

    Same arguments and result as `latent_scheme`.
    """
    heads, qk, rope, v = dims
    key, value = _up_project(latent, up_weight, heads, qk, rope, v)
    index = layout.unzigzag_index()
    key = _ExpandedAllGather.apply(key, group).index_select(0, index)
    value = _ExpandedAllGather.apply(value, group).index_select(0, index)
    return cp_attention.attend_segments(query, key, value, layout.query_segments(rank),
                                        (qk + rope) ** -0.5, packed=False)


SCHEMES = {"latent": latent_scheme, "expanded": expanded_scheme}
_COUNTED = ((cp_attention, "all_gather_single"), (cp_attention, "reduce_scatter_single"),
            (collectives, "all_gather_single"), (collectives, "reduce_scatter_single"))


@contextlib.contextmanager
def counted_collectives():
    """Count what every all-gather / reduce-scatter moves per rank while the block runs.

    Patches the module-level names the CP code calls (`attention/cp.py` binds
    them from `parallel/collectives.py` at import, so patching torch.distributed
    would miss them). Yields a list of (kind, bytes) per call: all-gather
    output minus input, reduce-scatter input minus output.
    """
    calls = []

    def counting(kind, fn):
        def wrapper(output, input, *args, **kwargs):
            big, small = (output, input) if kind == "all_gather" else (input, output)
            calls.append((kind, big.numel() * big.element_size() - small.numel() * small.element_size()))
            return fn(output, input, *args, **kwargs)
        return wrapper

    saved = [(module, name, getattr(module, name)) for module, name in _COUNTED]
    try:
        for module, name, fn in saved:
            setattr(module, name, counting(name.split("_single")[0], fn))
        yield calls
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _compare_body(rank, world, seq, dims, kv_lora, repeats):
    """One CP rank: run both schemes, check they agree, return bytes and best wall times."""
    heads, qk, rope, v = dims
    layout = ZigzagLayout((seq,), world)
    same_on_every_rank = torch.Generator().manual_seed(0)
    up_weight = torch.randn(heads * (qk + v), kv_lora, generator=same_on_every_rank) * kv_lora ** -0.5
    g = torch.Generator().manual_seed(1 + rank)
    latent = torch.randn(layout.local_length, 1, kv_lora + rope, generator=g)
    query = torch.randn(layout.local_length, 1, heads, qk + rope, generator=g)
    grad_out = torch.randn(layout.local_length, 1, heads * v, generator=g)
    steps, report, seen = {}, {}, {}
    for name, scheme in SCHEMES.items():
        leaves = [t.clone().requires_grad_() for t in (latent, query, up_weight)]

        def step(scheme=scheme, leaves=leaves):
            for t in leaves:
                t.grad = None
            out = scheme(*leaves, layout, rank, dims)
            out.backward(grad_out)
            return out.detach(), [t.grad for t in leaves]

        with counted_collectives() as calls:  # the warm-up step is the counted one
            out, grads = step()
        grads[2] = grads[2].clone()
        dist.all_reduce(grads[2])  # each rank holds part of the up-projection's gradient
        steps[name], seen[name] = step, [out, *grads]
        report[name] = {"bytes": sum(b for _, b in calls), "calls": [k for k, _ in calls]}
    times = {name: [] for name in SCHEMES}
    for _ in range(repeats):  # interleaved, so drifting load on the machine hits both alike
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    for name in SCHEMES:
        slowest = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        report[name]["ms"] = 1000 * slowest.min().item()
    for what, a, b in zip(("output", "latent grad", "query grad", "up-projection grad"),
                          seen["latent"], seen["expanded"]):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"rank {rank}: latent and expanded schemes disagree on the {what} "
                               f"(max abs diff {(a - b).abs().max().item():.3g}); the comparison is void")
    return report


def timing_table(cps=(2, 4), seq=2048, heads=8, repeats=5) -> list[str]:
    from tests.distributed import run_distributed

    tiny = get_preset("tiny")
    dims = (heads, tiny.qk_head_dim, tiny.qk_pos_emb_head_dim, tiny.v_head_dim)
    lines = [f"(c) measured on CPU gloo: CP all-gather + K/V up-projection + attention, fwd+bwd, seq {seq}, "
             f"{heads} heads, kv_lora={tiny.kv_lora_rank} qk={dims[1]} rope={dims[2]} v={dims[3]}, fp32; "
             f"bytes per rank fwd+bwd, slowest rank, best of {repeats}; outputs and gradients allclose"]
    for cp in cps:
        res = run_distributed(_compare_body, cp, seq, dims, tiny.kv_lora_rank, repeats, timeout=600)
        lat, exp = res[0]["latent"], res[0]["expanded"]
        if lat["calls"] != ["all_gather", "reduce_scatter"] or \
                exp["calls"] != ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]:
            raise RuntimeError(f"unexpected collectives: latent {lat['calls']}, expanded {exp['calls']}")
        lines.append(f"    CP={cp}: latent all-gather {lat['bytes'] / 2**20:.2f} MiB, {lat['ms']:.0f} ms | "
                     f"expanded K/V all-gather {exp['bytes'] / 2**20:.2f} MiB, {exp['ms']:.0f} ms | "
                     f"bytes ratio {lat['bytes'] / exp['bytes']:.4f}, time ratio {lat['ms'] / exp['ms']:.3f}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-timing", action="store_true", help="only (a) and (b), no processes")
    p.add_argument("--timing-cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--timing-seq", type=int, default=2048)
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
