"""A plan as text tables (for people) or one JSON object (for scripts)."""
from __future__ import annotations

from .plan import GiB, Plan

MEMORY_LABELS = {
    "parameters": "parameters",
    "main_weights": "fp32 main weights",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state",
    "activations": "activations (saved for backward)",
    "kv_latent_all_gather": "KV-latent all-gather buffers",
    "logits_and_loss": "logits",
    "moe_dispatch_buffers": "MoE dispatch buffers",
    "fsdp_buffers": "FSDP all-gather buffers",
    "transient": "backward / loss working set",
    "reserved": "reserved (context, NCCL, fragmentation)",
}
EXACT = {"parameters", "main_weights", "gradients", "optimizer_state"}


def _gib(n: float) -> str:
    return f"{n / GiB:10.2f}"


def _header(p: Plan) -> list[str]:
    s, c = p.setup, p.setup.model
    lay = s.layout
    recompute = s.recompute
    if recompute.recompute_granularity == "full":
        rc = f"full, {recompute.recompute_method}, {recompute.recompute_num_layers} layer(s)"
    elif recompute.recompute_granularity == "selective":
        rc = "selective: " + " ".join(recompute.recompute_modules or ("core_attn",))
    else:
        rc = "none"
    sharding = (f"hsdp: dense weights over {s.shard} ranks x {s.world_size // s.shard} replicas, experts over "
                f"EDP={lay.edp}" if s.data_parallel_sharding == "hsdp" else "ddp (replicated weights)")
    experts = f" ({c.num_experts // s.ep} of {c.num_experts} experts per GPU)" if c.num_moe_layers else ""
    return [
        f"plan: {s.model_preset}, stage {s.stage} (sequence {s.seq}), {s.nodes} x {s.gpus_per_node} {s.gpu.name} "
        f"= {s.world_size} GPUs",
        f"  dense mesh TP={s.tp} x CP={s.cp} x DP={lay.dp}; expert mesh EP={s.ep} x EDP={lay.edp}{experts}",
        f"  {sharding}; optimizer {s.optimizer}; {'bf16' if s.bf16 else 'fp32'}; layers {s.transformer_impl}",
        f"  micro-batch {s.micro_batch_size} ({s.micro_batch_size * s.seq // s.cp} tokens per GPU), global batch "
        f"{s.global_batch} ({s.micro_batches} micro-batch(es) per step); recompute {rc}; "
        f"dispatch {s.moe_dispatch_precision}",
    ]


def format_text(p: Plan) -> str:
    s = p.setup
    lines = _header(p) + ["", f"{'memory per GPU (rank 0)':<44}{'GiB':>10}"]
    for key, label in MEMORY_LABELS.items():
        tag = "exact" if key in EXACT else "estimate"
        lines.append(f"  {label:<42}{_gib(p.memory[key])}  {tag}")
    cap = s.capacity
    lines += [f"  {'total':<42}{_gib(p.memory['total'])}",
              f"  {'capacity (' + s.gpu.name + ')':<42}{_gib(cap)}",
              f"  {'fits':<42}{'yes' if p.fits else 'NO':>10}", ""]
    lines.append(f"{'activations per layer, one micro-batch':<44}{'no recompute':>14}{'this plan':>14}")
    for kind, (none, mine) in p.per_layer.items():
        lines.append(f"  {kind + ' layer':<42}{none / GiB:>10.3f} GiB{mine / GiB:>10.3f} GiB")
    lines += ["", f"{'communication per GPU per step':<50}{'group':<22}{'link':<8}{'GiB':>9}{'s':>9}  overlap"]
    for col in p.collectives:
        bw = (s.gpu.ib_gbps if col.inter_node else s.gpu.nvlink_gbps) * 1e9
        lines.append(f"  {col.name:<48}{col.group:<22}{'IB' if col.inter_node else 'NVLink':<8}"
                     f"{col.bytes_per_step / GiB:>9.2f}{col.bytes_per_step / bw:>9.3f}  "
                     f"{'yes' if col.overlapped else 'no'}")
    sec, fl = p.seconds, p.flops
    mfu = s.mfu or s.gpu.mfu
    lines += ["", "step time (estimate)",
              f"  {'model FLOPs per GPU':<42}{fl['model'] / 1e12:10.1f} TFLOP",
              f"  {'+ recompute, + CP K/V up-projection':<42}"
              f"{(fl['recompute'] + fl['cp_kv_up_projection']) / 1e12:10.1f} TFLOP",
              f"  {'compute at MFU ' + format(mfu, '.2f') + ' of ' + format(s.gpu.bf16_tflops, 'g') + ' TFLOP/s':<42}"
              f"{sec['compute']:10.3f} s",
              f"  {'overlapped NVLink / IB traffic':<42}{sec['nvlink_overlapped']:10.3f} s / "
              f"{sec['ib_overlapped']:.3f} s",
              f"  {'exposed communication':<42}{sec['exposed_communication']:10.3f} s",
              f"  {'Muon Newton-Schulz':<42}{sec['optimizer']:10.3f} s",
              f"  {'step':<42}{sec['step']:10.3f} s",
              f"  {'tokens/s per GPU; effective MFU':<42}{sec['tokens_per_second_per_gpu']:10.0f}   "
              f"{sec['effective_mfu']:.2f}",
              f"  links: NVLink {s.gpu.nvlink_gbps:g} GB/s within {s.domain} GPUs, InfiniBand {s.gpu.ib_gbps:g} GB/s "
              f"per GPU"]
    if p.advice:
        lines += [""] + p.advice
    return "\n".join(lines)


def to_json(p: Plan) -> dict:
    s = p.setup
    comm: dict = {}
    for col in p.collectives:
        comm[col.name] = comm.get(col.name, 0) + col.bytes_per_step
    return {
        "model_preset": s.model_preset, "stage": s.stage, "seq_length": s.seq, "gpu": s.gpu.name,
        "nodes": s.nodes, "gpus_per_node": s.gpus_per_node, "world_size": s.world_size,
        "tp": s.tp, "cp": s.cp, "ep": s.ep, "dp": s.dp, "edp": s.layout.edp,
        "data_parallel_sharding": s.data_parallel_sharding, "dense_shard_size": s.shard,
        "optimizer": s.optimizer, "bf16": s.bf16, "micro_batch_size": s.micro_batch_size,
        "global_batch_size": s.global_batch, "micro_batches_per_step": s.micro_batches,
        "recompute": {"granularity": s.recompute.recompute_granularity, "method": s.recompute.recompute_method,
                      "num_layers": s.recompute.recompute_num_layers,
                      "modules": list(s.recompute.recompute_modules) if s.recompute.recompute_modules else None},
        "memory_bytes": dict(p.memory),
        "exact_memory_categories": sorted(EXACT),
        "capacity_bytes": s.capacity,
        "fits": p.fits,
        "activation_bytes_per_layer": {k: {"no_recompute": v[0], "this_plan": v[1]} for k, v in p.per_layer.items()},
        "communication_bytes": comm,
        "collectives": [{"name": c.name, "group": c.group, "group_size": c.group_size,
                         "link": "ib" if c.inter_node else "nvlink", "bytes_per_step": c.bytes_per_step,
                         "overlapped": c.overlapped} for c in p.collectives],
        "flops_per_gpu": dict(p.flops),
        "seconds": dict(p.seconds),
        "step_seconds": p.step_seconds,
        "assumptions": {"mfu": s.mfu or s.gpu.mfu, "bf16_tflops": s.gpu.bf16_tflops,
                        "nvlink_gbps": s.gpu.nvlink_gbps, "ib_gbps": s.gpu.ib_gbps, "nvlink_domain": s.domain,
                        "reserved_bytes": s.reserved_bytes},
        "advice": p.advice,
    }
