"""One-GPU CPT step of the `small` preset: tokens/s, memory and MFU, ours vs plain megatron-core.

    python benchmarks/gpu_step.py [--seq-length 4096] [--micro-batch-size 1] [--steps 10]
                                  [--transformer-impl local|transformer_engine] [--peak-tflops X]

Both runs are bf16 on the same random tokens, in this one process, one after
the other (each alone on the GPU, so its peak memory is its own):

* ours: `training.Trainer.step()` with `--bf16`: the `small` preset (MLA,
  sigmoid group-limited routing with expert bias, shared expert, grouped
  experts, one MTP layer trained by self-distillation), bf16 weights with fp32
  main weights and gradients, megatron-core DDP, foreach AdamW, fp64 gradient
  norm, non-finite guard, clipping.
* baseline: a plain megatron-core `GPTModel` of the same size (layers, hidden,
  heads, dense / expert FFN sizes, experts, top-k, shared expert, vocab, one
  megatron MTP layer) from megatron-core's own layer spec: with Transformer
  Engine its TE spec with MLA (`MLATransformerConfig`, the same attention
  sizes as ours), without TE its local spec, where megatron-core 0.16.1 has
  no MLA core attention, so standard multi-head attention with RoPE at
  head size hidden / heads. Softmax top-k router, megatron's experts, its
  built-in LM and MTP cross-entropy, bf16 parameters in megatron-core's
  DDP with fp32 gradient buffers, `torch.optim.AdamW(fused=True)` and
  `clip_grad_norm_`: what a plain megatron-core training script does.

MFU is model FLOPs (`config.model.training_flops_per_token`, the same
formula for both, with ours' attention sizes) over the GPU's dense bf16 peak
(`--peak-tflops`, else a table of known GPUs). Targets on an H200 at seq 4096:
ours/baseline tokens/s >= 0.9 and MFU >= 35%.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets, SXM parts, no sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 989.4,
    "H800": 989.4, "H20": 148.0, "GH200": 989.4, "B200": 2250.0, "GB200": 2500.0, "B300": 2250.0,
    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0, "L4": 121.0,
}


def peak_tflops(name: str):
    """The table entry whose key is the longest substring of the device name, or None."""
    hits = [k for k in PEAK_BF16_TFLOPS if k in name]
    return PEAK_BF16_TFLOPS[max(hits, key=len)] if hits else None


def baseline_step_fn(cfg, seq: int, mbs: int, data, te: bool, device: torch.device):
    """A plain megatron-core GPTModel of the same size (see the module docstring)."""
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
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
        params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=device.type == "cpu", mtp_num_layers=cfg.mtp_num_layers or None,
        gradient_accumulation_fusion=False, bias_activation_fusion=device.type == "cuda", apply_rope_fusion=te,
        masked_softmax_fusion=False, persist_layer_norm=False, moe_permute_fusion=te,
    )
    if te:
        tconfig = MLATransformerConfig(
            **common, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
            v_head_dim=cfg.v_head_dim, rotary_base=cfg.rotary_base, rope_type="rope")
        position = "none"
    else:
        tconfig = TransformerConfig(**common)
        position = "rope"
    block = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=te, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(tconfig, block, use_transformer_engine=te) if cfg.mtp_num_layers else None
    model = GPTModel(config=tconfig, transformer_layer_spec=block, vocab_size=cfg.vocab_size,
                     max_sequence_length=seq, position_embedding_type=position, mtp_block_spec=mtp).to(device)
    model = DistributedDataParallel(config=tconfig, module=model,
                                    ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
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


def ours_step_fn(cfg, seq: int, mbs: int, data, transformer_impl: str):
    from megatron_composer.config import OptimizerConfig, TrainingConfig
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.training import Trainer, TrainingData

    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    extra = {"transformer_impl": transformer_impl} if "transformer_impl" in fields else {}
    train_cfg = TrainingConfig(seq_length=seq, micro_batch_size=mbs, bf16=True, train_iters=10**6,
                               optimizer=OptimizerConfig(lr=1e-4, lr_decay_iters=10**6), **extra)
    trainer = Trainer(cfg, ParallelLayout(world_size=1), TrainingData(data), train_cfg)
    return lambda: trainer.step().lm_loss


def measure(name: str, build, steps: int, warmup: int) -> dict:
    """Build a run, warm it up, time `steps` steps (each synchronized); peak memory since the build."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step = build()
    losses = [step() for _ in range(warmup)]
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - t)
    result = {"name": name, "seconds": statistics.median(times),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
              "first_loss": losses[0], "last_loss": losses[-1]}
    del step
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                    help="default: transformer_engine when it imports, else local (both runs)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run both steps on CPU (tiny sizes; checks the script, measures nothing)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        sys.exit("benchmarks/gpu_step.py needs a CUDA GPU; on CPU run benchmarks/cpt_throughput.py "
                 "(or this script with --cpu-smoke --preset tiny --seq-length 128 to check it runs)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    from megatron_composer.config import get_preset
    from megatron_composer.config.model import training_flops_per_token
    from megatron_composer.data import RandomTokenDataset
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    import importlib.util

    te = importlib.util.find_spec("transformer_engine") is not None
    impl = args.transformer_impl or ("transformer_engine" if te else "local")
    torch.backends.cuda.matmul.allow_tf32 = True
    init_distributed()
    cfg = get_preset(args.preset)
    seq, mbs = args.seq_length, args.micro_batch_size
    data = RandomTokenDataset(16, seq, cfg.vocab_size)
    tokens = seq * mbs
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none (CPU smoke run)"
    peak = args.peak_tflops or peak_tflops(gpu)
    flops = training_flops_per_token(cfg, seq)

    runs = [measure("ours", lambda: ours_step_fn(cfg, seq, mbs, data, impl), args.steps, args.warmup)]
    if not args.no_baseline:
        initialize_parallel(ParallelLayout(world_size=1), seed=1234)
        runs.append(measure("megatron-core GPTModel", lambda: baseline_step_fn(cfg, seq, mbs, data,
                                                                            impl == "transformer_engine", device),
                            args.steps, args.warmup))

    print(f"GPU {gpu}, torch {torch.__version__}, transformer impl {impl}, dense bf16 peak "
          f"{peak or 'unknown (pass --peak-tflops)'} TFLOP/s")
    print(f"{args.preset} preset CPT step, bf16, seq {seq} x micro-batch {mbs} = {tokens} tokens, "
          f"{args.steps} steps (median), {flops / 1e9:.2f} GFLOP per token")
    for r in runs:
        tps = tokens / r["seconds"]
        mfu = f"{100 * tps * flops / (peak * 1e12):5.1f}%" if peak else "n/a"
        print(f"{r['name']:>24}: {r['seconds'] * 1000:8.1f} ms/step {tps:10.0f} tokens/s  peak memory "
              f"{r['peak_gib']:6.2f} GiB  MFU {mfu}  lm loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    ours = runs[0]
    if peak:
        print(f"MFU ours: {100 * tokens / ours['seconds'] * flops / (peak * 1e12):.1f}% (target >= 35% on H200)")
    if len(runs) > 1:
        print(f"ratio ours/baseline tokens/s: {runs[1]['seconds'] / ours['seconds']:.3f} (target >= 0.9); "
              f"peak memory ours/baseline: {ours['peak_gib'] / runs[1]['peak_gib']:.3f}")


if __name__ == "__main__":
    main()
