"""Plan a training run: per-GPU memory, per-step communication, step time, and whether it fits.

    python tools/plan.py --model-preset kimi-k2.5 --stage cpt-32k --nodes 16 --gpus-per-node 8 \\
        --gpu h200 --tp 1 --cp 2 --ep 8 [--optimizer muon] [--recompute] [--json]
    python tools/plan.py --stage rl --model-preset small --nodes 4 --cp 8 --data-parallel-sharding ddp \\
        --trainer-ranks 8 --inference-workers 16 --prompt-tokens 2048 --response-tokens 30720 \\
        --prompts-per-step 128 --group-size 16 --rl-micro-batch-tokens 65536

`--stage rl` plans `train_rl.py`: the trainer ranks (or, without
--inference-workers, the synchronous driver on every GPU), the inference
workers and the rollout (`megatron_composer/planner/rl.py`).

Flags are `pretrain_cpt.py`'s (--tp, --cp, --ep are short for
--tensor-model-parallel-size, --context-parallel-size,
--expert-model-parallel-size), plus the cluster (--nodes, --gpus-per-node,
--gpu) and the hardware assumptions, whose defaults are the GPU's datasheet
figures (`megatron_composer/planner/hardware.py`). Parameters, gradients and
optimizer state are exact; activations, buffers, traffic and time are
estimates (`megatron_composer/planner/`). Nothing is built or allocated.
Exit status: 0 when the plan fits, 1 when it does not, 2 for bad flags.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.config import PRESETS, STAGES, get_preset  # noqa: E402
from megatron_composer.config.training import RECOMPUTE_MODULES, RecomputeConfig  # noqa: E402
from megatron_composer.planner.hardware import GPUS, get_gpu  # noqa: E402

GiB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and stage")
    g.add_argument("--model-preset", default="kimi-k2.5", help=f"one of {', '.join(PRESETS)}")
    g.add_argument("--stage", default="cpt-32k", help=f"one of {', '.join(STAGES)} (sets the sequence length), "
                   f"or rl (train_rl.py)")
    g.add_argument("--seq-length", type=int, default=None, help="default: the stage's full-scale length; rl: the "
                   "longest sample, the engines' max_model_len (default: prompt + response tokens)")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size (one micro-batch per step)")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 compute with fp32 main weights, gradients and optimizer state (--no-bf16: all fp32)")
    g.add_argument("--optimizer", choices=["adam", "muon"], default="adam")
    g.add_argument("--muon-granularity", choices=["matrix", "head"], default="head")
    g.add_argument("--moe-dispatch-precision", choices=["bf16", "mxfp8"], default="bf16",
                   help="EP dispatch payload (combine stays bf16)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local: our grouped experts save their stacked weights for backward; "
                        "transformer_engine: TE's grouped GEMM does not")

    g = p.add_argument_group("cluster and layout")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpu", default="h200", help=f"one of {', '.join(GPUS)}")
    g.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    g.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1)
    g.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="must be 1 (the recipe has no PP)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1, help="must be 1")
    g.add_argument("--data-parallel-sharding", choices=["ddp", "hsdp"], default="hsdp",
                   help="hsdp (the recipe's dual-mesh FSDP2; pretrain_cpt.py's default is ddp) or ddp")
    g.add_argument("--dense-shard-size", type=int, default=None,
                   help="HSDP shard group of dense weights (a multiple of CP); default: max(CP, 2), as the trainer")

    g = p.add_argument_group("activation recompute (Megatron-LM's flags)")
    g.add_argument("--recompute", action="store_true",
                   help="short for --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="+", choices=list(RECOMPUTE_MODULES), default=None)

    g = p.add_argument_group("RL (--stage rl; train_rl.py's flags)")
    g.add_argument("--trainer-ranks", type=int, default=None,
                   help="trainer GPUs with --inference-workers (default: every GPU the workers leave)")
    g.add_argument("--inference-workers", type=int, default=0,
                   help="async RL's inference workers (0: the synchronous driver, an engine on every trainer rank)")
    g.add_argument("--inference-gpus-per-worker", type=int, default=1,
                   help="1: a whole model per worker (what train_rl.py runs); G > 1: experts split over G GPUs")
    g.add_argument("--prompt-tokens", type=int, default=1024, help="prompt tokens per sample")
    g.add_argument("--response-tokens", type=int, default=None,
                   help="generated tokens per sample, all turns (default: --seq-length - --prompt-tokens)")
    g.add_argument("--prompts-per-step", type=int, default=4, help="groups per step")
    g.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    g.add_argument("--rollout-batch-size", type=int, default=64, help="engine cache slots")
    g.add_argument("--rl-micro-batch-tokens", dest="micro_batch_tokens", type=int, default=None,
                   help="packed tokens per training micro-batch (default: --seq-length)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="> 0: the reference model is on every trainer rank")
    g.add_argument("--reference-offload", action="store_true",
                   help="the reference model in host memory between steps (train_rl.py's flag)")
    g.add_argument("--ppo-mini-batches", type=int, default=1)

    g = p.add_argument_group("hardware assumptions (defaults: the GPU's datasheet figures)")
    g.add_argument("--mfu", type=float, default=None, help="model FLOPs utilization of compute (default 0.40)")
    g.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink GB/s per GPU and direction "
                   "(h100/h200 450, b200/gb200 900)")
    g.add_argument("--ib-gbps", type=float, default=None, help="InfiniBand GB/s per GPU and direction (50: one "
                   "400 Gb/s NIC per GPU)")
    g.add_argument("--hbm-gbps", type=float, default=None, help="HBM GB/s per GPU (rollout decode; h100 3350, "
                   "h200 4800, b200/gb200 8000)")
    g.add_argument("--nvlink-domain-size", type=int, default=None,
                   help="GPUs joined by one NVLink fabric (default: the node; gb200: 72)")
    g.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="usable HBM per GPU in GiB (default: the datasheet's, h200 141 GB = 131.3 GiB)")
    g.add_argument("--reserved-gib", type=float, default=5.0,
                   help="kept aside for the CUDA context, NCCL buffers and allocator fragmentation")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def setup_from_args(args):
    """A `PlanSetup` from parsed flags; ValueError naming the flag for values that cannot work."""
    from megatron_composer.planner.plan import PlanSetup

    if args.model_preset not in PRESETS:
        raise ValueError(f"unknown --model-preset {args.model_preset!r}; choose one of: {', '.join(PRESETS)}")
    if args.stage not in STAGES and args.stage != "rl":
        raise ValueError(f"unknown --stage {args.stage!r}; choose one of: {', '.join(STAGES)}, rl")
    for name in ("pipeline_model_parallel_size", "expert_tensor_parallel_size"):
        if getattr(args, name) != 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: the planner models 1 (the recipe "
                             f"scales with CP x EP x FSDP)")
    for name in ("tp", "cp", "ep", "nodes", "gpus_per_node", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.recompute:
        if args.recompute_granularity or args.recompute_method or args.recompute_num_layers or args.recompute_modules:
            raise ValueError("--recompute is short for full uniform recompute of every layer; "
                             "drop it or the --recompute-* flags")
        recompute = RecomputeConfig("full", "uniform", 1)
    else:
        recompute = RecomputeConfig.from_args(args)
    gpu = get_gpu(args.gpu).replace(nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps, hbm_gbps=args.hbm_gbps)
    for name in ("nvlink_gbps", "ib_gbps", "hbm_gbps", "gpu_memory_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    return PlanSetup(
        model=get_preset(args.model_preset), model_preset=args.model_preset, stage=args.stage,
        seq_length=args.seq_length, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=gpu, tp=args.tp,
        cp=args.cp, ep=args.ep, data_parallel_sharding=args.data_parallel_sharding,
        dense_shard_size=args.dense_shard_size, optimizer=args.optimizer, muon_granularity=args.muon_granularity,
        bf16=args.bf16, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        recompute=recompute, moe_dispatch_precision=args.moe_dispatch_precision,
        transformer_impl=args.transformer_impl, mfu=args.mfu,
        gpu_memory_bytes=int(args.gpu_memory_gib * GiB) if args.gpu_memory_gib else None,
        reserved_bytes=int(args.reserved_gib * GiB), nvlink_domain=args.nvlink_domain_size)


def rl_setup_from_args(args):
    """An `RLPlanSetup` from parsed flags (--stage rl)."""
    from megatron_composer.planner.rl import RLPlanSetup, RolloutShape

    if args.global_batch_size is not None or args.micro_batch_size != 1:
        raise ValueError("--stage rl: a step is --prompts-per-step x --group-size samples packed into "
                         "--rl-micro-batch-tokens micro-batches; drop --micro-batch-size / --global-batch-size")
    seq = args.seq_length
    if args.response_tokens is None and seq is None:
        raise ValueError("--stage rl needs the rollout length: --response-tokens (and --prompt-tokens), or "
                         "--seq-length")
    response = args.response_tokens if args.response_tokens is not None else seq - args.prompt_tokens
    rollout = RolloutShape(prompt_tokens=args.prompt_tokens, response_tokens=response,
                           prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                           rollout_batch_size=args.rollout_batch_size, seq_length=seq,
                           micro_batch_tokens=args.micro_batch_tokens)
    cluster = setup_from_args(args).replace(seq_length=None)
    return RLPlanSetup(cluster, rollout, trainer_ranks=args.trainer_ranks, inference_workers=args.inference_workers,
                       inference_gpus_per_worker=args.inference_gpus_per_worker, kl_coef=args.kl_coef,
                       reference_offload=args.reference_offload,
                       ppo_mini_batches=args.ppo_mini_batches)


def rl_setup_from_run(run, *, nodes: int, gpus_per_node: int, gpu: str = "h200", prompt_tokens: int = 1024):
    """The `RLPlanSetup` of a parsed `train_rl.py` command (`rl.arguments.parse_rl_args`) on `nodes` x
    `gpus_per_node` GPUs: its model, trainer layout, inference workers and rollout, each sample planned at
    --seq-length tokens of which `prompt_tokens` are prompt. The layers are planned as the local spec (whose
    grouped experts save their stacked weights; Transformer Engine's save none), whatever this machine has."""
    from megatron_composer.planner.plan import PlanSetup
    from megatron_composer.planner.rl import RLPlanSetup, RolloutShape
    from megatron_composer.training.arguments import resolve_model_config

    t, rl, par = run.training, run.rl, run.parallel
    model = resolve_model_config(dataclasses.replace(run.model, load=None), get_preset(run.model.preset).vocab_size)
    cluster = PlanSetup(model, stage="rl", nodes=nodes, gpus_per_node=gpus_per_node, gpu=get_gpu(gpu),
                        model_preset=run.model.preset, tp=par.tensor_model_parallel_size,
                        cp=par.context_parallel_size, ep=par.expert_model_parallel_size,
                        data_parallel_sharding=t.data_parallel_sharding, dense_shard_size=t.dense_shard_size,
                        optimizer=t.optimizer.optimizer, muon_granularity=t.optimizer.muon_granularity, bf16=t.bf16,
                        recompute=t.recompute, moe_dispatch_precision=t.moe_precision.moe_dispatch_precision,
                        transformer_impl="local")
    rollout = RolloutShape(prompt_tokens, t.seq_length - prompt_tokens, rl.rollout.prompts_per_step,
                           rl.rollout.group_size, rl.rollout.rollout_batch_size, t.seq_length,
                           rl.algorithm.micro_batch_tokens)
    workers = run.async_rl.inference_workers if run.async_rl.enabled else 0
    return RLPlanSetup(cluster, rollout, trainer_ranks=run.async_rl.trainer_ranks if workers else None,
                       inference_workers=workers, kl_coef=rl.algorithm.kl_coef,
                       reference_offload=rl.algorithm.reference_offload,
                       ppo_mini_batches=rl.algorithm.ppo_mini_batches)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_composer.planner.plan import make_plan
    from megatron_composer.planner.report import format_rl_text, format_text, rl_to_json, to_json
    from megatron_composer.planner.rl import make_rl_plan

    rl = args.stage == "rl"
    try:
        plan = make_rl_plan(rl_setup_from_args(args)) if rl else make_plan(setup_from_args(args))
    except ValueError as exc:
        parser.error(str(exc))  # exits 2, argparse's way
    if args.json:
        print(json.dumps(rl_to_json(plan) if rl else to_json(plan), indent=2))
    else:
        print(format_rl_text(plan) if rl else format_text(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
