"""One-GPU CPT step of the `small` preset at seq 4096: tokens/s, step time, MFU and peak memory,
ours (local layers, and Transformer Engine's when it imports) against megatron-core's GPTModel.

    python benchmarks/gpu_step.py [--preset small] [--seq-length 4096] [--micro-batch-size 1]
                                  [--steps 8] [--warmup 3] [--peak-tflops X] [--no-baseline]
    python benchmarks/gpu_step.py --device cpu --preset tiny --seq-length 256 --steps 2  # checks the script

The runs go one after the other in this process, each alone on the device (so its peak memory is
its own), all bf16 on the same random tokens. Each prints its line the moment it finishes; a run
that fails prints its error instead and the next one starts.

* ours local / ours transformer_engine: `training.Trainer.step()` with `--bf16` and
  `--transformer-impl` local or transformer_engine (TE only where it imports): MLA, sigmoid
  group-limited routing with expert bias, shared expert, grouped experts, one MTP layer trained by
  self-distillation, bf16 weights with fp32 main weights and gradients, megatron-core DDP, AdamW,
  fp64 gradient norm, non-finite guard, clipping.
* megatron-core GPTModel: a plain megatron-core model of the same size (layers, hidden, heads,
  dense / expert FFN sizes, experts, top-k, shared expert, vocab, one megatron MTP layer) from
  megatron-core's own layer spec: with TE its TE spec with MLA (`MLATransformerConfig`, the same
  attention sizes as ours), without TE its local spec, where megatron-core 0.16.1 has no MLA core
  attention, so standard multi-head attention with RoPE at head size hidden / heads. Softmax top-k
  router, megatron's experts, its built-in LM and MTP cross-entropy, bf16 parameters in
  megatron-core's DDP with fp32 gradient buffers, `torch.optim.AdamW(fused=True)` and
  `clip_grad_norm_`: what a plain megatron-core training script does.

MFU = tokens/s x model FLOPs per token / the GPU's dense bf16 peak. The FLOPs are
`config.model.training_flops_per_token` (the same for every run, with ours' attention sizes), the
peak is `--peak-tflops` or the planner's table of datasheet figures (`planner/hardware.py`).
Targets on an H200: MFU >= 35% for ours, ours / megatron-core tokens/s >= 0.9.

Each result line starts with `gpu_step: `, the lines `tools/gpu_check.sh` puts in its summary.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import re
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

PREFIX = "gpu_step: "


def peak_bf16_tflops(device_name: str) -> Optional[float]:
    """Dense bf16 peak of the GPU `torch.cuda.get_device_name()` names, from the planner's GPU table
    (SXM datasheet figures); None for a GPU not in it, and for PCIe / NVL parts, whose clocks and
    so peaks are lower than the SXM figure."""
    from megatron_composer.planner.hardware import GPUS

    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    if words & {"pcie", "nvl"}:
        return None
    hits = [spec.bf16_tflops for name, spec in GPUS.items() if name in words]
    return hits[0] if len(hits) == 1 else None


def mfu(tokens_per_second: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilization: the model FLOPs done per second over the peak, a fraction."""
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12)


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    seconds: float  # median step
    tokens: int  # per step
    peak_gib: Optional[float]  # None off CUDA
    first_loss: float
    last_loss: float

    def line(self, flops_per_token: float, peak_tflops: Optional[float]) -> str:
        tps = self.tokens / self.seconds
        util = f"{100 * mfu(tps, flops_per_token, peak_tflops):.1f}%" if peak_tflops else "n/a"
        memory = f"{self.peak_gib:.2f} GiB" if self.peak_gib is not None else "n/a"
        return (f"{PREFIX}{self.name}: {tps:.0f} tokens/s, {1000 * self.seconds:.1f} ms/step, MFU {util}, "
                f"peak memory {memory}, lm loss {self.first_loss:.3f} -> {self.last_loss:.3f}")


def run_all(runs: list, measure: Callable, emit: Callable[[str], None], flops_per_token: float,
            peak_tflops: Optional[float]) -> list[Result]:
    """`measure(name, build)` each `(name, build)` run in turn and `emit` its line as soon as it is
    done; a run that raises emits `<name>: FAILED <error>` (traceback on stderr) and the next goes on.
    Returns the results of the runs that finished."""
    results = []
    for name, build in runs:
        try:
            result = measure(name, build)
        except Exception as error:  # a baseline's failure must not hide the other runs
            traceback.print_exc()
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            emit(f"{PREFIX}{name}: FAILED {type(error).__name__}: {first_line}")
        else:
            results.append(result)
            emit(result.line(flops_per_token, peak_tflops))
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return results


def ours_training_config(seq: int, mbs: int, transformer_impl: str):
    """Our bf16 CPT step's `TrainingConfig` at this shape with these layers."""
    from megatron_composer.config import OptimizerConfig, TrainingConfig
    from megatron_composer.config.training import TransformerImplConfig

    return TrainingConfig(seq_length=seq, micro_batch_size=mbs, bf16=True, train_iters=10**6,
                          optimizer=OptimizerConfig(lr=1e-4, lr_decay_iters=10**6),
                          transformer=TransformerImplConfig(transformer_impl=transformer_impl))


def ours_step_fn(cfg, seq: int, mbs: int, data, transformer_impl: str):
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.training import Trainer, TrainingData

    trainer = Trainer(cfg, ParallelLayout(world_size=1), TrainingData(data),
                      ours_training_config(seq, mbs, transformer_impl))
    return lambda: trainer.step().lm_loss


def baseline_config(cfg, te: bool, cuda: bool):
    """megatron-core's config for the baseline of the same size (see the module docstring) and its
    position embedding: MLA with TE, standard multi-head attention with RoPE without."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    common = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
        num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_router_topk, moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_layer_freq=[0] * cfg.first_k_dense_layers + [1] * cfg.num_moe_layers,
        moe_grouped_gemm=te, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=not cuda,
        mtp_num_layers=cfg.mtp_num_layers or None, gradient_accumulation_fusion=False,
        bias_activation_fusion=cuda, masked_softmax_fusion=False, persist_layer_norm=False,
        moe_permute_fusion=te,
        # megatron-core fuses MLA's RoPE for YaRN only (MLATransformerConfig refuses plain RoPE)
        apply_rope_fusion=False,
    )
    if not te:
        return TransformerConfig(**common), "rope"
    return MLATransformerConfig(
        **common, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim, rotary_base=cfg.rotary_base, rope_type="rope"), "none"


def baseline_step_fn(cfg, seq: int, mbs: int, data, te: bool, device: torch.device):
    """A plain megatron-core GPTModel of the same size (see the module docstring)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel

    initialize_parallel(ParallelLayout(world_size=1), seed=1234)
    cuda = device.type == "cuda"
    tconfig, position = baseline_config(cfg, te, cuda)
    block = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=te, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(tconfig, block, use_transformer_engine=te) if cfg.mtp_num_layers else None
    model = GPTModel(config=tconfig, transformer_layer_spec=block, vocab_size=cfg.vocab_size,
                     max_sequence_length=seq, position_embedding_type=position, mtp_block_spec=mtp).to(device)
    model = DistributedDataParallel(config=tconfig, module=model,
                                    ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    causal = None if te else torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None]
    positions = torch.arange(seq, device=device).expand(mbs, seq)
    state = {"i": 0}

    def step():
        rows = [data[(state["i"] * mbs + j) % len(data)] for j in range(mbs)]
        state["i"] += 1
        tokens, labels, mask = (torch.stack([r[k] for r in rows]).to(device, non_blocking=True)
                                for k in ("tokens", "labels", "loss_mask"))
        model.zero_grad_buffer()
        per_token = model(tokens, positions, causal, labels=labels, loss_mask=mask)
        loss = (per_token.float() * mask).sum() / mask.sum()
        loss.backward()
        finalize_model_grads([model])
        for p in params:
            p.grad = p.main_grad.to(p.dtype)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss.item()

    return step


def measure(name: str, build: Callable, steps: int, warmup: int, tokens: int) -> Result:
    """Build a run, warm it up, time `steps` steps (each synchronized); peak memory since the build."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step = build()
    losses = [step() for _ in range(warmup)]
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return Result(name, statistics.median(times), tokens, peak, losses[0], losses[-1])


def plan_runs(cfg, seq: int, mbs: int, data, device: torch.device, te: bool, baseline: bool) -> list:
    """(name, build) of each run: ours local, ours TE (where TE imports), megatron-core's GPTModel."""
    impls = ["local"] + (["transformer_engine"] if te else [])
    runs = [(f"ours {impl}", lambda impl=impl: ours_step_fn(cfg, seq, mbs, data, impl)) for impl in impls]
    if baseline:
        runs.append((f"megatron-core GPTModel {impls[-1]}",
                     lambda: baseline_step_fn(cfg, seq, mbs, data, te, device)))
    return runs


def ratio_line(results: list[Result]) -> Optional[str]:
    """Ours over megatron-core with the same layers: tokens/s and peak memory."""
    by_name = {r.name: r for r in results}
    for r in results:
        if r.name.startswith("megatron-core GPTModel "):
            ours = by_name.get("ours " + r.name.rsplit(" ", 1)[1])
            if ours is not None:
                memory = (f", peak memory {ours.peak_gib / r.peak_gib:.3f}"
                          if ours.peak_gib and r.peak_gib else "")
                return (f"{PREFIX}ratio {ours.name} / {r.name}: tokens/s {r.seconds / ours.seconds:.3f} "
                        f"(target >= 0.9){memory}")
    return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak of the GPU (default: the planner's table by device name)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: check the script on a machine without a GPU (measures nothing)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_step.py needs a CUDA GPU; to check the script on CPU: "
                 "--device cpu --preset tiny --seq-length 256 --steps 2")
    if args.device == "cpu" and torch.cuda.is_available():
        sys.exit("--device cpu checks the script on a machine without a GPU; here, hide the GPU "
                 "(CUDA_VISIBLE_DEVICES=) or drop --device cpu")
    device = torch.device(args.device)

    from megatron_composer.config import get_preset
    from megatron_composer.config.model import training_flops_per_token
    from megatron_composer.data import RandomTokenDataset
    from megatron_composer.platform import init_distributed

    te = device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    init_distributed()
    cfg = get_preset(args.preset)
    seq, mbs = args.seq_length, args.micro_batch_size
    data = RandomTokenDataset(16, seq, cfg.vocab_size)
    flops = training_flops_per_token(cfg, seq)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none (CPU check)"
    peak = args.peak_tflops or (peak_bf16_tflops(gpu) if device.type == "cuda" else None)
    print(f"GPU {gpu}, dense bf16 peak {peak or 'unknown (pass --peak-tflops)'} TFLOP/s, "
          f"torch {torch.__version__}, Transformer Engine {'imports' if te else 'absent: local layers only'}")
    print(f"{args.preset} preset CPT step, bf16, seq {seq} x micro-batch {mbs} = {seq * mbs} tokens per step, "
          f"median of {args.steps} steps after {args.warmup} warm-up, {flops / 1e9:.2f} GFLOP per token",
          flush=True)
    runs = plan_runs(cfg, seq, mbs, data, device, te, baseline=not args.no_baseline)
    results = run_all(runs, lambda name, build: measure(name, build, args.steps, args.warmup, seq * mbs),
                      lambda line: print(line, flush=True), flops, peak)
    ratio = ratio_line(results)
    if ratio:
        print(ratio, flush=True)
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
