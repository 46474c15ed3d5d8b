"""Plan a training run before launching it: per-GPU memory, per-step communication, step time.

`make_plan(PlanSetup(...))` (`plan.py`) combines:

* `config.model.parameter_inventory`: every parameter one rank holds, from the
  `ModelConfig` (its sum is `count_parameters`, the one parameter count);
* `states.py`: exact bytes of parameters, main weights, gradients and
  optimizer state under DDP and dual-mesh HSDP;
* `activations.py`: the activation-side peak of one micro-batch (estimate);
* `comm.py`: bytes per collective per step (estimate, from the trainer's collectives);
* `hardware.py`: GPU kinds with datasheet defaults;
* `advice.py`: which knob makes a layout fit;
* `rl.py`: RL (`make_rl_plan(RLPlanSetup(...))`): the trainer ranks with the
  reference model and the log-prob peak, the inference workers, the rollout;
* `inference.py`: one rollout engine's weights, latent cache and decode time,
  and the start-up check that refuses an inference worker that cannot fit;
* `report.py`: text tables and JSON.

No library computes these figures for this trainer's layers and dual
meshes, so they are written here; the exact parts reuse the optimizer's own
rules (`optim.param_groups.muon_split`, `optim.sharded_muon.plan_buckets`)
and are tested against a built model.
"""
from ..config.model import ParamEntry, parameter_inventory
from .activations import (
    ActivationPlan,
    ActivationSetup,
    activation_plan,
    layer_activations,
)
from .hardware import GPUS, GPUSpec, get_gpu
from .inference import EngineShape, check_inference_worker_fits, engine_memory, kv_cache_bytes
from .plan import Plan, PlanSetup, make_plan, plan_memory
from .rl import RLPlan, RLPlanSetup, RolloutShape, make_rl_plan
from .states import StateBytes, default_dense_shard_size, optimizer_kinds, state_bytes

__all__ = [
    "ActivationPlan", "ActivationSetup", "EngineShape", "GPUS", "GPUSpec", "ParamEntry", "Plan", "PlanSetup",
    "RLPlan", "RLPlanSetup", "RolloutShape", "StateBytes", "activation_plan", "check_inference_worker_fits",
    "default_dense_shard_size", "engine_memory", "get_gpu", "kv_cache_bytes", "layer_activations", "make_plan",
    "make_rl_plan", "optimizer_kinds", "parameter_inventory", "plan_memory", "state_bytes",
]
