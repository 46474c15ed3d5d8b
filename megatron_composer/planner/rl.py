"""Plan an RL run (`train_rl.py`): trainer GPUs, inference workers and rollout length -> memory, fits, time.

    setup = RLPlanSetup(PlanSetup(get_preset("small"), stage="rl", nodes=4, gpus_per_node=8, gpu=get_gpu("h200"),
                                  cp=8, data_parallel_sharding="ddp"),
                        RolloutShape(prompt_tokens=2048, response_tokens=30720, prompts_per_step=128, group_size=16,
                                     micro_batch_tokens=65536),
                        trainer_ranks=8, inference_workers=16)
    plan = make_rl_plan(setup)       # raises ValueError naming a size that cannot run
    plan.fits, plan.trainer.memory["total"], plan.inference_memory["total"], plan.step_seconds

`cluster` carries the trainer's layout and the hardware, as `PlanSetup` does for CPT; its sequence and batch
are derived here. What one trainer GPU holds in an RL step, as `rl/trainer.py` runs it today:

* the policy's parameters, gradients and optimizer state, exactly as in CPT (`states.py`);
* the reference model when `--kl-coef` > 0 (exact; `rl/reference.py`): a second model at the trainer's
  layout in fp32, 4 bytes for every parameter of the rank's EP share, under HSDP sharded like the policy
  (padded fp32 shards, as `states.state_bytes` counts the policy's); with `reference_offload` it sits in
  host memory and the GPU holds it only during the step's reference forwards, before training
  (`parts["reference_phase"]`: the states, the reference, one gathered fp32 unit under HSDP, the
  log-probs), at the cost of copying its bytes host-to-device once per step;
* the activations of one packed micro-batch (`activations.py`): samples of prompt + response tokens packed
  whole into `--rl-micro-batch-tokens` (floor(M / L) samples of L tokens), padded to a multiple of 2 x CP and
  split over CP; attention FLOPs span one sample, not the micro-batch;
* the log-probs: `rl.loss.PolicyLoss` keeps the logits [T, V] (`logits`) and computes log-probs and
  entropy in chunks of positions like the CPT loss (`activations.LOSS_CHUNKS_LIVE` fp32 chunks);
  `chunked_logprobs=False` plans the unchunked path (`LOGPROB_FP32_TENSORS` fp32 [T x V] tensors) for
  comparison; the plan counts the larger of that and the backward working set;
* with the synchronous driver (no inference workers), the colocated engine's latent cache
  (`inference.kv_cache_bytes`, in the compute dtype): allocated at the first rollout and kept through
  training; while sampling, the engine's step working set comes on top of the states (the rollout phase).

With inference workers (`--async-rl`), each holds a whole model on its GPU (`inference.py`), and the trainer
ranks and the workers' GPUs must fit the cluster. Not counted: the reference forward's own transient (it
runs before training, with no activations saved), the evaluator (its engine has `--episode-workers` slots),
host memory.

Time (estimate): the trainer step is `plan.make_plan`'s over the step's packed micro-batches, plus one
no-grad forward for the reference log-probs (`--kl-coef`) and one for the old log-probs
(`--ppo-mini-batches` > 1); the rollout is `inference.rollout_seconds` over the inference workers, or over
the data-parallel ranks' colocated engines. An RL step takes rollout + train in the synchronous loop and the
longer of the two in the asynchronous one (sampling overlaps training).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..config.model import ModelConfig, parameter_inventory
from .activations import CUDA_LOSS_CHUNK_ELEMENTS, LOSS_CHUNKS_LIVE
from .advice import advise as find_knobs
from .comm import unit_sizes
from .inference import (
    EngineShape,
    check_inference_worker_fits,
    engine_memory,
    kv_cache_bytes,
    peak_bytes,
    rollout_seconds,
)
from .plan import GiB, Plan, PlanSetup, make_plan, plan_memory
from .states import state_bytes

LOGPROB_FP32_TENSORS = 5  # the unchunked log-prob path's fp32 [T x V] tensors alive at once (module docstring)


@dataclass(frozen=True)
class RolloutShape:
    """What a step samples; names follow `train_rl.py`'s flags. Every sample is planned at its longest."""

    prompt_tokens: int
    response_tokens: int
    prompts_per_step: int = 4
    group_size: int = 8
    rollout_batch_size: int = 64  # engine cache slots
    seq_length: Optional[int] = None  # the longest sample, the engine's max_model_len (default: prompt + response)
    micro_batch_tokens: Optional[int] = None  # --rl-micro-batch-tokens (default: seq_length)

    @property
    def sample_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def seq(self) -> int:
        return self.seq_length or self.sample_tokens

    @property
    def micro_tokens(self) -> int:
        return self.micro_batch_tokens or self.seq

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.group_size

    def validate(self) -> None:
        for name in ("prompt_tokens", "response_tokens", "prompts_per_step", "group_size", "rollout_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.sample_tokens > self.seq:
            raise ValueError(f"--prompt-tokens {self.prompt_tokens} + --response-tokens {self.response_tokens} = "
                             f"{self.sample_tokens} exceeds --seq-length {self.seq}; raise --seq-length or "
                             f"shorten the rollout")
        if self.micro_tokens < self.seq:
            raise ValueError(f"--rl-micro-batch-tokens {self.micro_tokens} is below --seq-length {self.seq}: a "
                             f"sample of full length would fit no micro-batch")


@dataclass(frozen=True)
class RLPlanSetup:
    """An RL run: the cluster and trainer layout (`cluster`), the rollout, the inference workers."""

    cluster: PlanSetup
    rollout: RolloutShape
    trainer_ranks: Optional[int] = None  # default: every GPU the inference workers leave
    inference_workers: int = 0  # 0: the synchronous driver, an engine colocated on every trainer rank
    inference_gpus_per_worker: int = 1  # 1: a whole model per worker (what train_rl.py runs)
    kl_coef: float = 0.0
    reference_offload: bool = False
    ppo_mini_batches: int = 1
    chunked_logprobs: bool = True

    def replace(self, **changes) -> "RLPlanSetup":
        return dataclasses.replace(self, **changes)

    @property
    def model(self) -> ModelConfig:
        return self.cluster.model

    @property
    def colocated(self) -> bool:
        return self.inference_workers == 0

    @property
    def inference_gpus(self) -> int:
        return self.inference_workers * self.inference_gpus_per_worker

    @property
    def trainer_world(self) -> int:
        if self.colocated:
            return self.cluster.world_size
        return self.trainer_ranks or self.cluster.world_size - self.inference_gpus

    @property
    def max_model_len(self) -> int:
        """The engines' longest sequence: `--seq-length`, at most the model's positions."""
        return min(self.rollout.seq, self.model.max_position_embeddings)

    @property
    def engine(self) -> EngineShape:
        return EngineShape(self.max_model_len, self.rollout.rollout_batch_size, self.inference_gpus_per_worker,
                           self.cluster.reserved_bytes)

    def validate(self) -> None:
        self.rollout.validate()
        c, r = self.cluster, self.rollout
        if self.inference_workers < 0 or self.inference_gpus_per_worker < 1 or self.ppo_mini_batches < 1:
            raise ValueError(f"--inference-workers {self.inference_workers} must be >= 0, "
                             f"--inference-gpus-per-worker {self.inference_gpus_per_worker} and --ppo-mini-batches "
                             f"{self.ppo_mini_batches} >= 1")
        if self.colocated and self.trainer_ranks not in (None, c.world_size):
            raise ValueError(f"--trainer-ranks {self.trainer_ranks} without --inference-workers: the synchronous "
                             f"driver trains on every GPU ({c.world_size}); add --inference-workers for --async-rl")
        world = self.trainer_world
        if world < 1 or world + self.inference_gpus > c.world_size:
            raise ValueError(f"--trainer-ranks {world} + --inference-workers {self.inference_workers} x "
                             f"{self.inference_gpus_per_worker} GPU(s) need {world + self.inference_gpus} GPUs; "
                             f"{c.nodes} x {c.gpus_per_node} has {c.world_size}; use more --nodes or fewer ranks")
        if world > c.gpus_per_node and world % c.gpus_per_node:
            raise ValueError(f"--trainer-ranks {world} spans nodes of {c.gpus_per_node} GPUs unevenly; use a "
                             f"multiple of {c.gpus_per_node} (or at most {c.gpus_per_node})")
        if r.prompts_per_step % self.ppo_mini_batches:
            raise ValueError(f"--prompts-per-step {r.prompts_per_step} is not divisible by --ppo-mini-batches "
                             f"{self.ppo_mini_batches}")
        if self.max_model_len < r.seq:
            raise ValueError(f"--seq-length {r.seq} exceeds the model's max_position_embeddings "
                             f"{self.model.max_position_embeddings}")


def packed_length(rl: RLPlanSetup) -> int:
    """Tokens of the fullest packed micro-batch: floor(M / L) samples of L tokens, padded to 2 x CP."""
    r, cp = rl.rollout, rl.cluster.cp
    tokens = (r.micro_tokens // r.sample_tokens) * r.sample_tokens
    step = 2 * cp if cp > 1 else 1
    return -(-tokens // step) * step


def micro_batches_per_rank(rl: RLPlanSetup, dp: int) -> int:
    """Packed micro-batches one data-parallel rank trains per step (over all mini-batches)."""
    r = rl.rollout
    per_bin = r.micro_tokens // r.sample_tokens
    per_rank = -(-r.samples // (rl.ppo_mini_batches * dp))
    return rl.ppo_mini_batches * -(-per_rank // per_bin)


def trainer_setup(rl: RLPlanSetup) -> PlanSetup:
    """The trainer's `PlanSetup`: its ranks, the packed micro-batch, the step's micro-batches and forwards."""
    rl.validate()
    c, world = rl.cluster, rl.trainer_world
    nodes, per_node = (world // c.gpus_per_node, c.gpus_per_node) if world > c.gpus_per_node else (1, world)
    dp = world // (c.tp * c.cp)
    forwards = (1 if rl.kl_coef else 0) + (1 if rl.ppo_mini_batches > 1 else 0)
    return c.replace(nodes=nodes, gpus_per_node=per_node, seq_length=packed_length(rl), micro_batch_size=1,
                     global_batch_size=max(1, dp) * micro_batches_per_rank(rl, max(1, dp)),
                     document_length=rl.rollout.sample_tokens, forward_passes=forwards,
                     nvlink_domain=c.domain)


def logprob_bytes(c: ModelConfig, tokens: int, chunked: bool) -> int:
    """The log-prob computation's peak beyond the logits, for `tokens` tokens on one rank (module docstring)."""
    if chunked:
        return LOSS_CHUNKS_LIVE * min(CUDA_LOSS_CHUNK_ELEMENTS, tokens * c.vocab_size) * 4
    return LOGPROB_FP32_TENSORS * tokens * c.vocab_size * 4


def reference_bytes(rl: RLPlanSetup) -> int:
    """The reference model's bytes on trainer rank 0 when --kl-coef > 0 (exact; module docstring), wherever
    it is held: fp32, the rank's EP share, under HSDP its padded shards."""
    if not rl.kl_coef:
        return 0
    t = trainer_setup(rl)
    inventory = parameter_inventory(rl.model, t.ep)
    if t.data_parallel_sharding != "hsdp":
        return 4 * sum(p.numel for p in inventory)
    return state_bytes(inventory, rl.model, sharding="hsdp", world_size=t.world_size, ep=t.ep,
                       dense_shard_size=t.shard, cp=t.cp).parameters


def _reference_unit_bytes(rl: RLPlanSetup) -> int:
    """Under HSDP, the largest reference unit gathered whole in fp32 during its forward (0 under DDP)."""
    t = trainer_setup(rl)
    if not rl.kl_coef or t.data_parallel_sharding != "hsdp":
        return 0
    return 4 * max(n for n, _ in unit_sizes(parameter_inventory(rl.model, t.ep)).values())


def trainer_memory(rl: RLPlanSetup) -> tuple[dict, dict]:
    """(memory by category with "total", its parts: "logprobs", "backward", "rollout_phase", "reference_phase")
    for trainer rank 0."""
    t = trainer_setup(rl)
    states, act, cpt, _ = plan_memory(t)
    logprobs = logprob_bytes(rl.model, t.seq // t.cp, rl.chunked_logprobs)
    a = 2 if t.bf16 else 4
    colocated = kv_cache_bytes(rl.model, rl.rollout.rollout_batch_size, rl.max_model_len, a) if rl.colocated else 0
    memory = {k: v for k, v in cpt.items() if k not in ("transient", "reserved", "total")}
    memory = {**{k: memory.pop(k) for k in ("parameters", "main_weights", "gradients", "optimizer_state")},
              "reference_model": 0 if rl.reference_offload else reference_bytes(rl), **memory,
              "transient": max(cpt["transient"], logprobs), "colocated_kv_cache": colocated,
              "reserved": cpt["reserved"]}
    memory["total"] = sum(memory.values())
    rollout_phase = None
    if rl.colocated:
        held = states.total + memory["reference_model"] + colocated + memory["fsdp_buffers"] + cpt["reserved"]
        rollout_phase = held + engine_memory(rl.model, rl.engine)["working_set"]
    reference_phase = None
    if rl.kl_coef and rl.reference_offload:  # copied in for the reference forwards, before any activation
        reference_phase = (states.total + reference_bytes(rl) + _reference_unit_bytes(rl) + logprobs + colocated
                           + cpt["reserved"])
    return memory, {"logprobs": logprobs, "backward": cpt["transient"], "rollout_phase": rollout_phase,
                    "reference_phase": reference_phase}


@dataclass
class RLPlan:
    setup: RLPlanSetup
    trainer: Plan  # its memory: `trainer_memory`'s categories
    parts: dict  # "logprobs", "backward", "rollout_phase", "reference_phase" (bytes)
    inference_memory: Optional[dict]  # one inference GPU (`inference.engine_memory`); None when colocated
    rollout: dict  # `inference.rollout_seconds`
    advice: list[str] = field(default_factory=list)

    @property
    def trainer_fits(self) -> bool:
        cap = self.setup.cluster.capacity
        return self.trainer.memory["total"] <= cap and max(self.parts["rollout_phase"] or 0,
                                                           self.parts["reference_phase"] or 0) <= cap

    @property
    def inference_fits(self) -> bool:
        return self.inference_memory is None or peak_bytes(self.inference_memory) <= self.setup.cluster.capacity

    @property
    def fits(self) -> bool:
        return self.trainer_fits and self.inference_fits

    @property
    def step_seconds(self) -> float:
        train, rollout = self.trainer.step_seconds, self.rollout["rollout"]
        return rollout + train if self.setup.colocated else max(rollout, train)


def make_rl_plan(rl: RLPlanSetup, advise: bool = True) -> RLPlan:
    """Plan `rl` (module docstring); raises ValueError for layouts that cannot run."""
    t = trainer_setup(rl)
    plan = make_plan(t, advise=False)
    plan.memory, parts = trainer_memory(rl)
    c, r, gpu = rl.model, rl.rollout, t.gpu
    inference = None if rl.colocated else engine_memory(c, rl.engine)
    engines = t.dp if rl.colocated else rl.inference_workers
    rollout = rollout_seconds(c, samples=r.samples, prompt_tokens=r.prompt_tokens, response_tokens=r.response_tokens,
                              workers=engines, slots=r.rollout_batch_size, hbm_gbps=gpu.hbm_gbps,
                              tflops=gpu.bf16_tflops, mfu=t.mfu or gpu.mfu,
                              gpus_per_worker=1 if rl.colocated else rl.inference_gpus_per_worker)
    out = RLPlan(rl, plan, parts, inference, rollout)
    if advise and plan.memory["total"] > rl.cluster.capacity:
        out.advice = find_knobs(rl.cluster, plan.memory["total"],
                                lambda x: trainer_memory(rl.replace(cluster=x))[0]["total"])
    if not out.inference_fits:
        try:
            check_inference_worker_fits(c, rl.engine, rl.cluster.capacity, rl.cluster.model_preset)
        except ValueError as exc:
            out.advice.append(str(exc))
    return out


def rl_summary(rl: RLPlanSetup) -> str:
    """One line: the trainer ranks and the inference workers on the cluster."""
    c = rl.cluster
    if rl.colocated:
        return f"{c.world_size} trainer ranks, each sampling with its colocated engine (synchronous driver)"
    held = "a whole model each" if rl.inference_gpus_per_worker == 1 else \
        f"1/{rl.inference_gpus_per_worker} of the experts per GPU"
    idle = c.world_size - rl.trainer_world - rl.inference_gpus
    return (f"{rl.trainer_world} trainer ranks, {rl.inference_workers} inference worker(s) x "
            f"{rl.inference_gpus_per_worker} GPU ({held}){f', {idle} GPU(s) idle' if idle else ''}")


__all__ = ["GiB", "LOGPROB_FP32_TENSORS", "RLPlan", "RLPlanSetup", "RolloutShape", "logprob_bytes", "make_rl_plan",
           "micro_batches_per_rank", "packed_length", "reference_bytes", "rl_summary", "trainer_memory",
           "trainer_setup"]
