"""Plan a training run: per-GPU memory, per-step communication, step time, and whether it fits.

    python tools/plan.py --model-preset kimi-k2.5 --stage cpt-32k --nodes 16 --gpus-per-node 8 \\
        --gpu h200 --tp 1 --cp 2 --ep 8 [--optimizer muon] [--recompute] [--json]

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
    g.add_argument("--stage", default="cpt-32k", help=f"one of {', '.join(STAGES)} (sets the sequence length)")
    g.add_argument("--seq-length", type=int, default=None, help="default: the stage's full-scale length")
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

    g = p.add_argument_group("hardware assumptions (defaults: the GPU's datasheet figures)")
    g.add_argument("--mfu", type=float, default=None, help="model FLOPs utilization of compute (default 0.40)")
    g.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink GB/s per GPU and direction "
                   "(h100/h200 450, b200/gb200 900)")
    g.add_argument("--ib-gbps", type=float, default=None, help="InfiniBand GB/s per GPU and direction (50: one "
                   "400 Gb/s NIC per GPU)")
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
    if args.stage not in STAGES:
        raise ValueError(f"unknown --stage {args.stage!r}; choose one of: {', '.join(STAGES)}")
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
    gpu = get_gpu(args.gpu).replace(nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps)
    for name in ("nvlink_gbps", "ib_gbps", "gpu_memory_gib"):
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


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_composer.planner.plan import make_plan
    from megatron_composer.planner.report import format_text, to_json

    try:
        plan = make_plan(setup_from_args(args))
    except ValueError as exc:
        parser.error(str(exc))  # exits 2, argparse's way
    print(json.dumps(to_json(plan), indent=2) if args.json else format_text(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
