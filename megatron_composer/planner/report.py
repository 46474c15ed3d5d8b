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


def _memory_table(title: str, memory: dict, labels: dict, exact: set, gpu_name: str, capacity: int,
                  fits: bool) -> list[str]:
    lines = [f"{title:<44}{'GiB':>10}"]
    for key, label in labels.items():
        lines.append(f"  {label:<42}{_gib(memory[key])}  {'exact' if key in exact else 'estimate'}")
    return lines + [f"  {'total':<42}{_gib(memory['total'])}",
                    f"  {'capacity (' + gpu_name + ')':<42}{_gib(capacity)}",
                    f"  {'fits':<42}{'yes' if fits else 'NO':>10}"]


def format_text(p: Plan) -> str:
    s = p.setup
    fits = p.memory["total"] <= s.capacity
    lines = _header(p) + [""] + _memory_table("memory per GPU (rank 0)", p.memory, MEMORY_LABELS, EXACT,
                                              s.gpu.name, s.capacity, fits) + [""]
    lines += _tables(p)
    if p.advice:
        lines += [""] + p.advice
    return "\n".join(lines)


def _tables(p: Plan) -> list[str]:
    """Activations per layer, communication and step time of a (trainer) plan."""
    s = p.setup
    lines = [f"{'activations per layer, one micro-batch':<44}{'no recompute':>14}{'this plan':>14}"]
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
              *([f"  {'+ no-grad forwards (reference, old log-probs)':<42}{fl['no_grad_forward'] / 1e12:10.1f} TFLOP"]
                if fl["no_grad_forward"] else []),
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
    return lines


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


# ---- RL (`planner.rl`) ---------------------------------------------------------------------------------
RL_MEMORY_LABELS = {
    "parameters": "parameters",
    "main_weights": "fp32 main weights",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state",
    "reference_model": "reference model (fp32, EP share or shard)",
    "activations": "activations (saved for backward)",
    "kv_latent_all_gather": "KV-latent all-gather buffers",
    "logits_and_loss": "logits",
    "moe_dispatch_buffers": "MoE dispatch buffers",
    "fsdp_buffers": "FSDP all-gather buffers",
    "transient": "log-probs or backward working set",
    "colocated_kv_cache": "colocated engine latent cache",
    "reserved": "reserved (context, NCCL, fragmentation)",
}
RL_EXACT = EXACT | {"reference_model", "colocated_kv_cache"}
ENGINE_LABELS = {
    "weights": "weights (bf16)",
    "kv_cache": "latent KV cache",
    "working_set": "engine step working set",
    "reserved": "reserved (context, fragmentation)",
}
ENGINE_EXACT = {"weights", "kv_cache"}


def _rl_header(p) -> list[str]:
    from .rl import packed_length, rl_summary

    rl, t = p.setup, p.trainer.setup
    r, c = rl.rollout, rl.cluster
    lay = t.layout
    per_bin = r.micro_tokens // r.sample_tokens
    sharding = (f"hsdp: dense weights over {t.shard} ranks x {t.world_size // t.shard} replicas, experts over "
                f"EDP={lay.edp}" if t.data_parallel_sharding == "hsdp" else "ddp (replicated weights)")
    experts = f" ({rl.model.num_experts // t.ep} of {rl.model.num_experts} experts per GPU)" \
        if rl.model.num_moe_layers else ""
    reference = ("none (--kl-coef 0)" if not rl.kl_coef else
                 "a second fp32 model of the rank's EP share on every trainer rank"
                 + (", sharded like the policy" if t.data_parallel_sharding == "hsdp" else "")
                 + (", in host memory between steps (--reference-offload)" if rl.reference_offload else ""))
    logprobs = "in chunks of positions" if rl.chunked_logprobs else "unchunked fp32 [T x V]"
    return [
        f"plan: {c.model_preset}, stage rl, {c.nodes} x {c.gpus_per_node} {c.gpu.name} = {c.world_size} GPUs: "
        f"{rl_summary(rl)}",
        f"  rollout: {r.prompts_per_step} prompts x {r.group_size} samples = {r.samples} samples per step of "
        f"{r.prompt_tokens} prompt + {r.response_tokens} response tokens (--seq-length {r.seq}); "
        f"{r.rollout_batch_size} cache slots per engine",
        f"  packing: {per_bin} sample(s) per {r.micro_tokens}-token micro-batch = {packed_length(rl)} tokens "
        f"({t.seq // t.cp} per GPU), {t.micro_batches} micro-batch(es) per DP rank per step "
        f"({rl.ppo_mini_batches} update(s))",
        f"  trainer: dense mesh TP={t.tp} x CP={t.cp} x DP={lay.dp}; expert mesh EP={t.ep} x EDP={lay.edp}{experts}",
        f"  {sharding}; optimizer {t.optimizer}; {'bf16' if t.bf16 else 'fp32'}; recompute "
        f"{t.recompute.recompute_granularity or 'none'}",
        f"  reference model: {reference}; log-probs: {logprobs}",
    ]


def format_rl_text(p) -> str:
    rl, t = p.setup, p.trainer.setup
    parts = p.parts
    lines = _rl_header(p) + [""] + _memory_table("memory per trainer GPU (rank 0)", p.trainer.memory,
                                                 RL_MEMORY_LABELS, RL_EXACT, t.gpu.name, t.capacity, p.trainer_fits)
    lines += [f"    of which log-probs {parts['logprobs'] / GiB:.2f} GiB, backward {parts['backward'] / GiB:.2f} GiB "
              f"(the larger counts: they do not overlap)"]
    if parts["rollout_phase"] is not None:
        lines.append(f"  {'rollout phase (states + engine step)':<42}{_gib(parts['rollout_phase'])}  estimate")
    if parts.get("reference_phase") is not None:
        lines.append(f"  {'reference phase (states + reference)':<42}{_gib(parts['reference_phase'])}  estimate")
    if p.inference_memory is not None:
        m = p.inference_memory
        lines += [""] + _memory_table("memory per inference GPU", m, ENGINE_LABELS, ENGINE_EXACT, t.gpu.name,
                                      t.capacity, p.inference_fits)
        lines.append(f"  {'start-up (fp32 model before the bf16 cast)':<42}{_gib(m['startup'])}  exact")
    lines += [""] + _tables(p.trainer)
    ro = p.rollout
    lines += ["", "rollout and RL step (estimate)",
              f"  {'sequences per engine; waves':<42}{ro['batch']:10d}   {ro['waves']}",
              f"  {'prefill + decode':<42}{ro['rollout']:10.3f} s",
              f"  {'generated tokens/s per engine':<42}{ro['generated_tokens_per_second_per_worker']:10.0f}",
              f"  {'RL step (' + ('rollout + train' if rl.colocated else 'max of rollout, train') + ')':<42}"
              f"{p.step_seconds:10.3f} s",
              f"  HBM {t.gpu.hbm_gbps:g} GB/s; no tool time, every sample at full length"]
    if p.advice:
        lines += [""] + p.advice
    return "\n".join(lines)


def rl_to_json(p) -> dict:
    rl = p.setup
    r = rl.rollout
    out = to_json(p.trainer)
    out.update({
        "stage": "rl", "fits": p.fits, "trainer_fits": p.trainer_fits, "inference_fits": p.inference_fits,
        "exact_memory_categories": sorted(RL_EXACT),
        "trainer_ranks": rl.trainer_world, "inference_workers": rl.inference_workers,
        "inference_gpus_per_worker": rl.inference_gpus_per_worker,
        "rollout": {"prompt_tokens": r.prompt_tokens, "response_tokens": r.response_tokens, "samples": r.samples,
                    "prompts_per_step": r.prompts_per_step, "group_size": r.group_size,
                    "rollout_batch_size": r.rollout_batch_size, "seq_length": r.seq,
                    "micro_batch_tokens": r.micro_tokens},
        "kl_coef": rl.kl_coef, "reference_offload": rl.reference_offload, "chunked_logprobs": rl.chunked_logprobs,
        "trainer_memory_parts": dict(p.parts),
        "inference_memory_bytes": p.inference_memory,
        "rollout_seconds": p.rollout, "train_step_seconds": p.trainer.step_seconds,
        "step_seconds": p.step_seconds, "advice": p.advice,
    })
    out["assumptions"]["hbm_gbps"] = rl.cluster.gpu.hbm_gbps
    return out
