"""Tokens/s of our tiny CPT training step against two megatron-core baselines.

    python benchmarks/cpt_throughput.py [--seq-length 512] [--micro-batch-size 4] [--steps 10]

All runs live in this one process, on the same random tokens, and are timed
interleaved (one step of each in turn), so machine noise hits them alike:

* ours: `training.Trainer.step()` on the tiny preset: `composer_forward`
  + our losses (LM cross-entropy, MTP self-distillation toward the main head),
  megatron-core DDP, foreach AdamW, foreach fp64 gradient norm, NaN guard,
  clipping, the finiteness check of the updated weights.
* "mcore on our spec": the very model `models.build_model` returns (MLA with
  our core attention, MoE with shared expert, sigmoid group-limited routing
  with expert bias, our grouped experts, MTP block), run through megatron-core's
  own `GPTModel.forward` with its built-in losses (LM cross-entropy and its MTP
  cross-entropy, `vocab_parallel_cross_entropy`), the same DDP wrapper,
  clipping and AdamW. The same work as ours, except that its MTP loss is
  cross-entropy on the label instead of self-distillation.
* "mcore local GPT": megatron-core 0.16.1's own local (non-TE) GPT layer spec,
  `get_gpt_decoder_block_spec(use_transformer_engine=False)`, with the same
  layers / hidden / heads / FFN sizes / experts / top-k / shared expert / vocab,
  but standard multi-head attention with RoPE (megatron-core 0.16.1 has no MLA
  core attention without Transformer Engine), a softmax top-k router (no groups,
  no expert bias), megatron's SequentialMLP experts and its built-in losses.

Both baselines step with `torch.optim.AdamW` in torch's default
implementation (on CPU the per-tensor loop; torch picks foreach only for
CUDA tensors) and `torch.nn.utils.clip_grad_norm_`, as a plain megatron-core
training script would. Each with one MTP layer (megatron-core's MTP block
for the baselines) and without MTP. Prints the median wall-clock and process-CPU time per step
(CPU time is less sensitive to other jobs on a shared machine) and ratios of
tokens/s, ours over each baseline.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _ddp(model, tconfig):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(config=tconfig, module=model,
                                   ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def megatron_step_fn(model, tconfig, data, seq: int, mbs: int, attention_mask=None):
    """One training step through megatron-core's `GPTModel.forward` and its losses
    (LM per-token cross-entropy; MTP cross-entropy attached inside the model)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    model = _ddp(model, tconfig)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    state = {"i": 0}

    def step():
        batch = [data[(state["i"] * mbs + j) % len(data)] for j in range(mbs)]
        state["i"] += 1
        tokens = torch.stack([b["tokens"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        loss_mask = torch.stack([b["loss_mask"] for b in batch])
        model.zero_grad_buffer()
        per_token = model(tokens, torch.arange(seq).expand(mbs, seq), attention_mask,
                          labels=labels, loss_mask=loss_mask)
        loss = (per_token * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        finalize_model_grads([model])
        for p in params:
            p.grad = p.main_grad
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss.item()

    return step


def local_gpt_step_fn(cfg, seq, mbs, data, mtp: bool):
    """megatron-core's local GPT spec of the same size (see the module docstring)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tconfig = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
        num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_router_topk, moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_layer_freq=[0] * cfg.first_k_dense_layers + [1] * cfg.num_moe_layers,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, use_cpu_initialization=True,
        mtp_num_layers=cfg.mtp_num_layers if mtp else None,
    )
    block = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=False, normalization="RMSNorm")
    mtp_spec = get_gpt_mtp_block_spec(tconfig, block, use_transformer_engine=False) if mtp else None
    model = GPTModel(config=tconfig, transformer_layer_spec=block, vocab_size=cfg.vocab_size,
                     max_sequence_length=seq, position_embedding_type="rope", mtp_block_spec=mtp_spec)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    return megatron_step_fn(model, tconfig, data, seq, mbs, attention_mask=causal)


def our_spec_step_fn(cfg, seq, mbs, data):
    """`build_model`'s model (our spec) through megatron-core's forward and losses."""
    from megatron_composer.models import build_model

    model = build_model(cfg, seq_length=seq, calculate_per_token_loss=True)
    return megatron_step_fn(model, model.config, data, seq, mbs)


def timed(runs: dict, steps: int, warmup: int):
    """Median (wall, process CPU) seconds per step of each run, interleaved."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for _ in range(steps):
        for name, fn in runs.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    return ({k: statistics.median(v) for k, v in wall.items()},
            {k: statistics.median(v) for k, v in cpu.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    from megatron_composer.config import get_preset
    from megatron_composer.data import RandomTokenDataset
    from megatron_composer.config import OptimizerConfig, TrainingConfig
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed
    from megatron_composer.training import Trainer, TrainingData

    init_distributed()
    cfg = get_preset("tiny")
    no_mtp = cfg.replace(mtp_num_layers=0)
    seq, mbs = args.seq_length, args.micro_batch_size
    data = RandomTokenDataset(64, seq, cfg.vocab_size)
    tokens = seq * mbs

    layout = ParallelLayout(world_size=1)
    train_cfg = TrainingConfig(seq_length=seq, micro_batch_size=mbs, optimizer=OptimizerConfig(lr=1e-3))
    ours = Trainer(cfg, layout, TrainingData(data), train_cfg)
    ours_no_mtp = Trainer(no_mtp, layout, TrainingData(data), train_cfg)
    initialize_parallel(layout, seed=1234)
    runs = {
        "ours": ours.step,
        "mcore on our spec": our_spec_step_fn(cfg, seq, mbs, data),
        "mcore local GPT": local_gpt_step_fn(cfg, seq, mbs, data, mtp=True),
        "ours (no MTP)": ours_no_mtp.step,
        "mcore on our spec (no MTP)": our_spec_step_fn(no_mtp, seq, mbs, data),
        "mcore local GPT (no MTP)": local_gpt_step_fn(cfg, seq, mbs, data, mtp=False),
    }
    wall, cpu = timed(runs, args.steps, args.warmup)

    print(f"tiny CPT step, seq {seq} x micro-batch {mbs} = {tokens} tokens, {args.steps} steps (median), "
          f"{torch.get_num_threads()} threads, one MTP layer unless '(no MTP)'")
    print("  ours: Trainer.step (composer_forward, fused LM CE + MTP self-distillation)")
    print("  mcore on our spec: build_model's model (MLA + our core attention, sigmoid group-limited "
          "routing, grouped experts) through megatron-core GPTModel.forward + its LM/MTP CE losses")
    print("  mcore local GPT: megatron-core 0.16.1 local spec: standard multi-head attention + RoPE, "
          "softmax router, SequentialMLP (no CPU MLA core attention in 0.16.1)")
    for name in runs:
        print(f"{name:>28}: {wall[name] * 1000:8.1f} ms/step wall {cpu[name] * 1000:8.1f} ms/step CPU "
              f"{tokens / wall[name]:9.0f} tokens/s")
    for base in ("mcore on our spec", "mcore local GPT"):
        for suffix, what in (("", "both with one MTP layer"), (" (no MTP)", "both without MTP")):
            b, o = base + suffix, "ours" + suffix
            print(f"ratio ours/baseline tokens/s vs {base}, {what}: {wall[b] / wall[o]:.3f} wall, "
                  f"{cpu[b] / cpu[o]:.3f} CPU")
    print("targets (vs the megatron-core local GPT baseline): >= 1.05 without MTP, >= 0.9 with MTP; "
          "vs mcore on our spec (the same model through megatron's forward) no target: it measures "
          "what our step adds or saves around the same modules")


if __name__ == "__main__":
    main()
