"""One plan: a layout on a cluster -> memory per GPU, communication per step, step time, fits.

    setup = PlanSetup(get_preset("kimi-k2.5"), stage="cpt-32k", nodes=16, gpus_per_node=8,
                      gpu=get_gpu("h200"), cp=2, ep=8)
    plan = make_plan(setup)          # raises ValueError naming a size that does not fit the cluster
    plan.fits, plan.memory["total"], plan.step_seconds, plan.advice

Exact: parameters, fp32 main weights, gradients and optimizer state
(`planner.states`). Estimated: activations and buffers (`planner.activations`),
communication volumes (`planner.comm`), and the step time:

    compute   = (model FLOPs + recomputed forward + CP's redundant K/V up-projection
                 + no-grad forwards) / (peak x MFU)
    optimizer = Newton-Schulz FLOPs / (peak x MFU)         (Muon; each block once, on its owner)
    step      = max(compute, overlapped NVLink traffic, overlapped InfiniBand traffic)
                + exposed traffic + optimizer

where a collective's time is its bytes over its link's bandwidth, and
"overlapped" ones run beside compute (FSDP2's prefetched all-gathers and
reduce-scatters, the CP latent gather that overlaps the query projection)
while "exposed" ones stall it (megatron-core's all-to-all dispatcher, DDP's
post-backward all-reduce, Muon's all-to-alls).

When a layout does not fit, `advice` says which knobs would make it fit,
found by re-planning with each one turned (recompute, micro-batch, CP,
dense shard size, EP, optimizer, nodes, Transformer Engine's experts).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..config.model import ModelConfig, parameter_inventory, training_flops_per_token
from ..config.stages import get_stage
from ..config.training import RecomputeConfig
from ..parallel.layout import ParallelLayout
from ..parallel.zigzag import check_divisible
from .activations import (
    ActivationPlan,
    ActivationSetup,
    activation_plan,
    layer_activations,
)
from .advice import advise as find_knobs
from .comm import Collective, CommSetup, collectives, newton_schulz_flops, unit_sizes
from .hardware import GPUSpec
from .states import StateBytes, default_dense_shard_size, state_bytes

GiB = 1 << 30


@dataclass(frozen=True)
class PlanSetup:
    """Everything a plan depends on; field names follow `pretrain_cpt.py`'s flags."""

    model: ModelConfig
    stage: str = "cpt-32k"
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: GPUSpec = None  # type: ignore[assignment]
    model_preset: str = "custom"
    seq_length: Optional[int] = None  # default: the stage's
    tp: int = 1
    cp: int = 1
    ep: int = 1
    data_parallel_sharding: str = "hsdp"
    dense_shard_size: Optional[int] = None
    optimizer: str = "adam"
    muon_granularity: str = "head"
    bf16: bool = True
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # default: micro-batch x DP (one micro-batch per step)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    moe_dispatch_precision: str = "bf16"
    transformer_impl: str = "local"
    mfu: Optional[float] = None  # default: the GPU's
    gpu_memory_bytes: Optional[int] = None  # default: the GPU's
    reserved_bytes: int = 5 * GiB  # CUDA context, NCCL buffers, allocator fragmentation
    nvlink_domain: Optional[int] = None  # default: the GPU's, else the node
    # packed documents (RL's samples): attention spans one document of this many tokens (default: the sequence)
    document_length: Optional[int] = None
    forward_passes: int = 0  # no-grad forwards over the step's tokens besides training (RL: reference, old log-probs)

    def replace(self, **changes) -> "PlanSetup":
        return dataclasses.replace(self, **changes)

    # ---- derived sizes ------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def seq(self) -> int:
        return self.seq_length or get_stage(self.stage).seq_length

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp)

    @property
    def shard(self) -> int:
        return self.dense_shard_size or default_dense_shard_size(self.world_size, self.cp)

    @property
    def context(self) -> int:
        """Tokens one attention spans: a packed document, else the whole sequence."""
        return self.document_length or self.seq

    @property
    def global_batch(self) -> int:
        return self.global_batch_size or self.micro_batch_size * self.dp

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch_size * self.dp)

    @property
    def domain(self) -> int:
        return min(self.nvlink_domain or self.gpu.nvlink_domain or self.gpus_per_node, self.world_size)

    @property
    def capacity(self) -> int:
        return self.gpu_memory_bytes or self.gpu.memory_bytes

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(world_size=self.world_size, tp=self.tp, cp=self.cp, ep=self.ep,
                              num_experts=self.model.num_experts if self.model.num_moe_layers else None)

    def validate(self) -> None:
        """Raise ValueError naming the first value that does not fit, and what would."""
        for name in ("nodes", "gpus_per_node", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.tp != 1:
            raise ValueError(f"--tp {self.tp}: the planner models TP = 1, the recipe's layout (CP x EP x FSDP; "
                             f"HSDP and Muon need TP = 1 too); use --cp to split long sequences")
        if self.data_parallel_sharding not in ("ddp", "hsdp"):
            raise ValueError(f"--data-parallel-sharding {self.data_parallel_sharding!r}; use ddp or hsdp")
        self.layout  # noqa: B018 - validates the meshes (errors list the sizes that fit)
        self.model.validate()
        self.recompute.check_layers(self.model.num_layers)
        r = self.recompute
        if self.model.mtp_num_layers and r.recompute_method == "uniform" and r.recompute_num_layers != 1:
            raise ValueError(f"--recompute-num-layers {r.recompute_num_layers} with MTP: megatron-core recomputes "
                             f"MTP layers one at a time, so --recompute-method uniform needs "
                             f"--recompute-num-layers 1 (or use block)")
        if self.cp > 1:
            check_divisible([self.seq], self.cp, packed=False)
        per_round = self.micro_batch_size * self.dp
        if self.global_batch % per_round:
            raise ValueError(f"--global-batch-size {self.global_batch} is not divisible by micro-batch-size x "
                             f"data-parallel size = {self.micro_batch_size} x {self.dp}; use a multiple of "
                             f"{per_round}")
        if self.data_parallel_sharding == "hsdp":
            world, shard = self.world_size, self.shard
            if world % shard:
                fits = [d for d in range(1, world + 1) if world % d == 0 and d % self.cp == 0]
                raise ValueError(f"--dense-shard-size {shard} must divide the data x context parallel size {world}; "
                                 f"use one of {fits}")
            if shard % self.cp:
                raise ValueError(f"--dense-shard-size {shard} must be a multiple of CP={self.cp} so that CP ranks "
                                 f"shard the dense weights together")
            if not self.model.untie_embeddings_and_output_weights:
                raise ValueError("--data-parallel-sharding hsdp needs untied embeddings and output weights")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu {self.mfu} must be in (0, 1], e.g. 0.4")


@dataclass
class Plan:
    setup: PlanSetup
    states: StateBytes
    activation: ActivationPlan
    memory: dict  # category -> bytes per GPU, "total" last
    per_layer: dict  # "dense"/"moe" -> (bytes without recompute, bytes with this plan's)
    collectives: list[Collective]
    flops: dict  # per GPU per step
    seconds: dict
    advice: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.setup.capacity

    @property
    def step_seconds(self) -> float:
        return self.seconds["step"]


def _fsdp_buffers(setup: PlanSetup, inventory) -> int:
    """HSDP, unsharded parameters in the compute dtype at the start of backward: every dense
    unit (each is an FSDP2 root, which FSDP2 does not reshard after forward) and two routed-expert
    units (the one computing and the one prefetched; they are resharded after forward)."""
    if setup.data_parallel_sharding != "hsdp":
        return 0
    units = unit_sizes(inventory).values()
    dense = sum(n for n, expert in units if not expert)
    experts = sorted((n for n, expert in units if expert), reverse=True)
    return (dense + sum(experts[:2])) * (2 if setup.bf16 else 4)


def _activation_setup(s: PlanSetup, recompute: Optional[RecomputeConfig] = None) -> ActivationSetup:
    return ActivationSetup(s.micro_batch_size, s.seq, cp=s.cp, ep=s.ep, bf16=s.bf16,
                           sharding=s.data_parallel_sharding, recompute=recompute or s.recompute, device="cuda",
                           transformer_impl=s.transformer_impl, moe_dispatch_precision=s.moe_dispatch_precision)


def plan_memory(s: PlanSetup) -> tuple[StateBytes, ActivationPlan, dict, list]:
    """(states, activations, memory by category, inventory) for rank 0."""
    s.validate()
    inventory = parameter_inventory(s.model, s.ep)
    states = state_bytes(inventory, s.model, sharding=s.data_parallel_sharding, world_size=s.world_size, ep=s.ep,
                         dense_shard_size=s.shard, cp=s.cp, optimizer=s.optimizer, bf16=s.bf16,
                         granularity=s.muon_granularity)
    act = activation_plan(s.model, _activation_setup(s))
    memory = {
        "parameters": states.parameters, "main_weights": states.main_weights, "gradients": states.gradients,
        "optimizer_state": states.optimizer_state, "activations": act.activations,
        "kv_latent_all_gather": act.kv_latent_all_gather, "logits_and_loss": act.logits_and_loss,
        "moe_dispatch_buffers": act.moe_dispatch_buffers, "fsdp_buffers": _fsdp_buffers(s, inventory),
        "transient": act.transient, "reserved": s.reserved_bytes,
    }
    memory["total"] = sum(memory.values())
    return states, act, memory, inventory


def _recompute_flops_per_token(c: ModelConfig, s: PlanSetup) -> float:
    """Forward FLOPs per token that recompute runs a second time."""
    r = s.recompute
    h, H = c.hidden_size, c.num_attention_heads
    dq = c.qk_head_dim + c.qk_pos_emb_head_dim
    attention = 2 * H * (dq + c.v_head_dim) * (s.context / 2)
    up = c.kv_lora_rank * H * (c.qk_head_dim + c.v_head_dim) + (c.q_lora_rank or h) * H * dq
    moe = 3 * h * c.moe_ffn_hidden_size * c.moe_router_topk + 3 * h * c.moe_shared_expert_intermediate_size
    layers = c.num_layers + c.mtp_num_layers
    if r.recompute_granularity == "full":
        forward = training_flops_per_token(c, s.context) / 3 - 2 * c.vocab_size * h
        share = 1.0 if r.recompute_method == "uniform" else min(r.recompute_num_layers or 0, c.num_layers) / layers
        return forward * share
    if r.recompute_granularity != "selective":
        return 0.0
    modules = r.recompute_modules or ("core_attn",)
    moe_layers = c.num_moe_layers + (c.mtp_num_layers if c.num_moe_layers else 0)
    flops = 0.0
    flops += attention * layers if "core_attn" in modules else 0
    flops += 2 * up * layers if "mla_up_proj" in modules else 0
    flops += 2 * (moe + c.num_experts * h) * moe_layers if "moe" in modules else 0
    flops += 2 * 3 * h * c.ffn_hidden_size * c.first_k_dense_layers if "mlp" in modules else 0
    flops += 2 * 3 * h * c.moe_shared_expert_intermediate_size * moe_layers if "shared_experts" in modules else 0
    return flops


def _timing(s: PlanSetup, inventory, comms: list[Collective]) -> tuple[dict, dict]:
    c, world = s.model, s.world_size
    tokens_per_gpu = s.global_batch * s.seq / world
    model = training_flops_per_token(c, s.context) * tokens_per_gpu
    recompute = _recompute_flops_per_token(c, s) * tokens_per_gpu
    no_grad_forward = s.forward_passes * model / 3
    kv_up = c.kv_lora_rank * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    cp_kv = 3 * 2 * kv_up * (s.cp - 1) * (c.num_layers + c.mtp_num_layers) * tokens_per_gpu
    ns_dense = ns_experts = 0.0
    if s.optimizer == "muon":
        ns_dense, ns_experts = newton_schulz_flops(inventory, c, s.muon_granularity)
        if s.data_parallel_sharding == "hsdp":  # each block once, on its owner
            ns_dense, ns_experts = ns_dense / s.shard, ns_experts / (world // s.ep)
    flops = {"model": model, "recompute": recompute, "cp_kv_up_projection": cp_kv,
             "no_grad_forward": no_grad_forward, "newton_schulz": ns_dense + ns_experts}
    mfu = s.mfu or s.gpu.mfu
    rate = s.gpu.bf16_tflops * 1e12 * mfu
    link = {True: s.gpu.ib_gbps * 1e9, False: s.gpu.nvlink_gbps * 1e9}
    seconds = {"compute": (model + recompute + cp_kv + no_grad_forward) / rate,
               "optimizer": flops["newton_schulz"] / rate,
               "nvlink_overlapped": 0.0, "ib_overlapped": 0.0, "exposed_communication": 0.0}
    for col in comms:
        t = col.bytes_per_step / link[col.inter_node]
        if not col.overlapped:
            seconds["exposed_communication"] += t
        else:
            seconds["ib_overlapped" if col.inter_node else "nvlink_overlapped"] += t
    seconds["step"] = (max(seconds["compute"], seconds["nvlink_overlapped"], seconds["ib_overlapped"])
                       + seconds["exposed_communication"] + seconds["optimizer"])
    seconds["tokens_per_second_per_gpu"] = tokens_per_gpu / seconds["step"]
    seconds["effective_mfu"] = model / (seconds["step"] * s.gpu.bf16_tflops * 1e12)
    return flops, seconds


def make_plan(s: PlanSetup, advise: bool = True) -> Plan:
    """Plan `s` (see the module docstring); raises ValueError for layouts that cannot run."""
    states, act, memory, inventory = plan_memory(s)
    none = _activation_setup(s, RecomputeConfig())
    mine = _activation_setup(s)
    kinds = {"dense": False, "moe": True} if s.model.num_moe_layers else {"dense": False}
    per_layer = {k: (layer_activations(s.model, none, moe).total, layer_activations(s.model, mine, moe).total)
                 for k, moe in kinds.items()}
    if s.recompute.recompute_granularity == "full":  # a recomputed layer keeps only its input
        kept = s.micro_batch_size * s.seq // s.cp * s.model.hidden_size * (2 if s.bf16 else 4)
        per_layer = {k: (v[0], kept) for k, v in per_layer.items()}
    r = s.recompute
    comms = collectives(s.model, inventory, CommSetup(
        world_size=s.world_size, cp=s.cp, ep=s.ep, sharding=s.data_parallel_sharding, dense_shard_size=s.shard,
        micro_batches=s.micro_batches, tokens=s.micro_batch_size * s.seq // s.cp, a=2 if s.bf16 else 4,
        nvlink_domain=s.domain, moe_dispatch_precision=s.moe_dispatch_precision, optimizer=s.optimizer,
        muon_granularity=s.muon_granularity,
        moe_recomputed=r.recompute_granularity == "full" or (r.recompute_granularity == "selective"
                                                             and "moe" in (r.recompute_modules or ())),
        attention_recomputed=r.recompute_granularity == "full"))
    flops, seconds = _timing(s, inventory, comms)
    plan = Plan(s, states, act, memory, per_layer, comms, flops, seconds)
    if advise and not plan.fits:
        plan.advice = find_knobs(s, memory["total"], lambda x: plan_memory(x)[2]["total"])
    return plan
