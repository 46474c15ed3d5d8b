"""Low-precision format benchmarks: dispatch bytes, NVFP4 scale recipes, quantizer speed.

    python benchmarks/quant.py

Each line says whether its figure is analytic (computed from the format
definitions alone) or measured (from running the code).

(a) analytic: MoE dispatch payload per token, MXFP8 (E4M3 data + one E8M0
    scale per 32) against BF16, for the kimi-k2.5 hidden size 7168 and the
    tiny model's 128: the sizes of the quantized tensors, no exchange.
(b) measured: NVFP4 relative error ||dq - x|| / ||x|| with one fp32 scale per token
    against one per tensor, on activations where 1% of tokens are outliers.
    Reported as the mean of the per-token errors and over the whole batch (the
    latter is dominated by the outlier tokens themselves). The recipes only
    differ once an outlier is so large (about 448 / 2**-6 ~ 3e4 times another
    token's block amax) that that token's per-tensor block scales fall into
    E4M3's subnormals or to zero, so several outlier sizes are run.
(c) measured: CPU throughput of the exact emulating quantizers, in GB/s of fp32 input.
(d) measured: dispatch bytes of one MoE layer (tiny preset, hidden 128 and 7168)
    at EP=2 over gloo, once with megatron's BF16 alltoall dispatcher and once
    with `moe.MXFP8AlltoAllTokenDispatcher`, counting the bytes handed to
    torch.distributed.all_to_all_single by the dispatch step (hidden states
    only; the fp32 routing probs, 4 B per routed token, are the same in both).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_composer.quant import (
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_nvfp4_per_tensor,
)


def dispatch_bytes(hidden: int) -> None:
    """Print MXFP8 vs BF16 bytes per dispatched token of width `hidden`."""
    token = torch.randn(1, hidden).bfloat16()
    q = quantize_mxfp8(token)
    bf16 = token.numel() * token.element_size()
    print(
        f"(a) analytic: dispatch hidden={hidden}: mxfp8 {q.nbytes} B/token ({q.data.numel()} data + {q.scale.numel()} scale), "
        f"bf16 {bf16} B/token, ratio {q.nbytes / bf16:.4f} (target <= 0.53)"
    )


def relative_errors(x: torch.Tensor, dq: torch.Tensor) -> tuple[float, float]:
    """(mean of per-token relative errors, whole-batch relative error); x, dq [tokens, hidden] fp32."""
    per_token = ((dq - x).norm(dim=-1) / x.norm(dim=-1)).mean().item()
    batch = ((dq - x).norm() / x.norm()).item()
    return per_token, batch


def nvfp4_outlier_error(tokens: int, hidden: int, outlier_scale: float) -> None:
    """Print per-token vs per-tensor NVFP4 error with 1% of tokens scaled by `outlier_scale`."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    outliers = torch.randperm(tokens, generator=g)[: max(1, tokens // 100)]
    x[outliers] *= outlier_scale
    tok_mean, tok_batch = relative_errors(x, dequantize_nvfp4(quantize_nvfp4(x)))
    ten_mean, ten_batch = relative_errors(x, dequantize_nvfp4(quantize_nvfp4_per_tensor(x)))
    print(
        f"(b) measured: nvfp4, 1% of tokens x{outlier_scale:,.0f}: per-token scale err mean {tok_mean:.4f} "
        f"batch {tok_batch:.4f} | per-tensor scale err mean {ten_mean:.4f} batch {ten_batch:.4f} | "
        f"per-tensor/per-token ratio mean {ten_mean / tok_mean:.2f} batch {ten_batch / tok_batch:.2f}"
    )


def throughput(name: str, fn, x: torch.Tensor, runs: int = 5) -> None:
    """Print the median GB/s (fp32 input bytes) of `fn(x)` after one warm-up call."""
    fn(x)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    gbytes = x.numel() * x.element_size() / 1e9
    print(
        f"(c) measured: {name} quantize {tuple(x.shape)} fp32 on {torch.get_num_threads()} CPU threads: "
        f"median {seconds * 1e3:.0f} ms over {runs} runs, {gbytes / seconds:.2f} GB/s"
    )


def _dispatched_hidden_bytes(layer, x: torch.Tensor) -> tuple[int, int]:
    """(tokens sent, bytes of hidden-state payload) of `layer`'s dispatch step on x [s, b, h]."""
    calls = []
    original = dist.all_to_all_single

    def recording(output, input, *args, **kwargs):
        calls.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    probs, routing_map = layer.route(x)
    tokens, permuted_probs = layer.preprocess(x, probs, routing_map)
    dist.all_to_all_single = recording
    try:
        layer.dispatch(tokens, permuted_probs)
    finally:
        dist.all_to_all_single = original
    return tokens.shape[0], sum(calls[:-1])  # the last call is the probs all_to_all


def _measure_dispatch_worker(rank: int, world: int, port: int, outdir: str, hidden: int) -> None:
    """One EP rank: build the tiny MoE layer at `hidden` with each dispatcher, save the counted bytes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core.transformer.spec_utils import build_module

    from megatron_composer.config import get_preset
    from megatron_composer.models import transformer_config
    from megatron_composer.models.builder import composer_block_spec
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    init_distributed()
    parallel = ParallelLayout(world_size=world, ep=world)
    initialize_parallel(parallel, seed=1234)
    cfg = dataclasses.replace(get_preset("tiny"), hidden_size=hidden)
    tconfig = transformer_config(cfg, parallel, params_dtype=torch.bfloat16)
    x = torch.randn(256, 1, hidden, generator=torch.Generator().manual_seed(rank)).bfloat16()
    result = {}
    for precision in ("bf16", "mxfp8"):
        spec = composer_block_spec(tconfig, moe_dispatch_precision=precision).layer_specs[-1].submodules.mlp
        with torch.no_grad():
            result[precision] = _dispatched_hidden_bytes(build_module(spec, config=tconfig, layer_number=2), x)
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measured_dispatch_bytes(hidden: int, world: int = 2) -> None:
    """Print the dispatch bytes counted at the all_to_all of the real dispatchers at EP=`world`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_measure_dispatch_worker, args=(world, port, outdir, hidden), nprocs=world)
        results = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
    tokens = sum(r["bf16"][0] for r in results)
    bf16 = sum(r["bf16"][1] for r in results)
    mxfp8 = sum(r["mxfp8"][1] for r in results)
    print(
        f"(d) measured: dispatch at EP={world}, hidden={hidden}: {tokens} routed tokens sent, "
        f"bf16 {bf16} B ({bf16 / tokens:.1f} B/token), mxfp8 {mxfp8} B ({mxfp8 / tokens:.1f} B/token), "
        f"ratio {mxfp8 / bf16:.4f}"
    )


def main() -> None:
    for hidden in (7168, 128):
        dispatch_bytes(hidden)
    for scale in (1e2, 1e4, 1e5, 1e6):
        nvfp4_outlier_error(tokens=2048, hidden=7168, outlier_scale=scale)
    x = torch.randn(4096, 7168, generator=torch.Generator().manual_seed(1))
    throughput("mxfp8", quantize_mxfp8, x)
    throughput("nvfp4", quantize_nvfp4, x)
    for hidden in (128, 7168):
        measured_dispatch_bytes(hidden)


if __name__ == "__main__":
    main()
