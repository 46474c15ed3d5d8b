"""Low-precision format benchmarks: dispatch bytes, NVFP4 scale recipes, quantizer speed.

    python benchmarks/quant.py                  # CPU: (a)-(d)
    python benchmarks/quant.py --device cuda    # one GPU: (e)-(f), under a minute on an H200

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
(e) measured, CUDA: the Triton quantizers (`quant/triton_kernels.py`) against
    the torch reference (`quant/formats.py`) on the same GPU, on a bf16
    [16384, 7168] activation: milliseconds, GB/s of input, reference/Triton.
(f) measured, CUDA: one expert GEMM forward + backward (fc1 of a DeepSeek-V3 /
    Kimi K2 expert: x [8192, 7168] @ w [4096, 7168].T, bf16 operands), bf16
    (torch's bf16 GEMMs) against the emulated mxfp8 and nvfp4 GEMMs
    (`quant/gemm.py`: Triton quantizers, weights quantized once as in
    training, fp32 matmuls; and nvfp4 quantizing the weight at every call).
    Hopper has no tensor cores for MX/NV block scales, so this emulation is
    what runs there; the ratio says what it costs.
"""
from __future__ import annotations

import argparse
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


def cuda_ms(fn, runs: int = 10) -> float:
    """Median milliseconds of fn() over `runs` CUDA-event-timed calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_quantizers(gpu: str) -> None:
    """(e): Triton vs torch-reference quantizers on one bf16 activation."""
    from megatron_composer.quant import formats, triton_kernels

    x = torch.randn(16384, 7168, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).bfloat16()
    q_mx, q_nv = triton_kernels.quantize_mxfp8(x), triton_kernels.quantize_nvfp4(x)
    cases = (
        ("mxfp8 quantize", triton_kernels.quantize_mxfp8, formats.quantize_mxfp8),
        ("nvfp4 quantize", triton_kernels.quantize_nvfp4, formats.quantize_nvfp4),
        ("mxfp8 dequantize -> bf16", lambda _: triton_kernels.dequantize_mxfp8(q_mx, torch.bfloat16),
         lambda _: formats.dequantize_mxfp8(q_mx, torch.bfloat16)),
        ("nvfp4 dequantize -> fp32", lambda _: triton_kernels.dequantize_nvfp4(q_nv),
         lambda _: formats.dequantize_nvfp4(q_nv)),
        ("mxfp8 fake-quantize -> fp32", lambda t: triton_kernels.fake_quantize(t, "mxfp8", torch.float32),
         lambda t: formats.fake_quantize(t, "mxfp8", torch.float32)),
        ("nvfp4 fake-quantize -> fp32", lambda t: triton_kernels.fake_quantize(t, "nvfp4", torch.float32),
         lambda t: formats.fake_quantize(t, "nvfp4", torch.float32)),
    )
    gbytes = x.numel() * x.element_size() / 1e9
    for name, kernel, reference in cases:
        t_kernel, t_reference = cuda_ms(lambda: kernel(x)), cuda_ms(lambda: reference(x))
        print(f"(e) measured: {name} {tuple(x.shape)} bf16 on {gpu}: triton {t_kernel:.3f} ms "
              f"({gbytes / t_kernel * 1e3:.0f} GB/s of bf16 input), torch reference {t_reference:.3f} ms, "
              f"reference/triton {t_reference / t_kernel:.1f}x")


def cuda_expert_gemm(gpu: str, tokens: int = 8192, hidden: int = 7168, out: int = 4096) -> None:
    """(f): bf16 vs emulated mxfp8 / nvfp4 expert GEMM, forward + backward."""
    from megatron_composer.quant import WeightQuantCache, quantized_linear

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(out, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(tokens, out, device="cuda", generator=g).bfloat16()
    flops = 3 * 2 * tokens * hidden * out
    times = {}
    for label, precision, cached in (("bf16", "bf16", False), ("mxfp8 emulated", "mxfp8", True),
                                     ("nvfp4 emulated", "nvfp4", True),
                                     ("nvfp4 emulated, weight quantized at every call", "nvfp4", False)):
        cache = WeightQuantCache()

        def step():
            y = quantized_linear(x, w, precision, cached=cache.get(w) if cached else None)
            torch.autograd.grad(y, [x, w], dy)

        times[label] = cuda_ms(step)
        torch.cuda.empty_cache()
    for label, ms in times.items():
        print(f"(f) measured: expert GEMM fwd+bwd x [{tokens}, {hidden}] @ w [{out}, {hidden}].T on {gpu}, "
              f"{label}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s, time vs bf16 {ms / times['bf16']:.1f}x")


def cuda_main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; run without --device for the CPU benchmarks")
    import triton

    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}, torch {torch.__version__}, triton {triton.__version__}")
    cuda_quantizers(gpu)
    cuda_expert_gemm(gpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    if parser.parse_args().device == "cuda":
        cuda_main()
        return
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
