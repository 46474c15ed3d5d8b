"""The RL policy update, composed on the shared `Trainer`: score, pack, train.

    rl = RLTrainer(model_cfg, layout, TrainingConfig(...), RLConfig(...), tokenizer)
    rl.resume()                          # --load: an SFT checkpoint (weights only) or an RL run
    samples = rl.rollouts(step)          # synchronous driver: the colocated engine (or, with
                                         # --rollout-backend vllm, a vLLM server), this rank's groups
    metrics = rl.train_on(samples)       # both drivers: one RL step on a step's samples

`RLTrainer` has a `training.Trainer` (it overrides none of its methods): it
sets the trainer's loss plug-ins (the policy loss, MTP, the feedback KL), its
`pre_forward` (router replay of each micro-batch's recorded experts) and its
checkpoint extras, and hands `Trainer.train_step` the micro-batches it built.

One RL step (`train_on`), the same for the synchronous loop (`rl/train.py`)
and the asynchronous trainer actors (`async_rl/services.py`):

1. rewards: each trajectory's verdict and the other `--reward` terms
   (`rewards.score`), optionally minus kl_coef * sum of per-token k1 KL to the
   frozen reference model (`--kl-placement reward`); advantages per group
   (`--advantage`);
2. packing: `packing.plan_step` balances the samples' cost (attention's
   quadratic term from the model shape) across data-parallel ranks, cuts each
   rank's share into micro-batches of at most `--rl-micro-batch-tokens`, and
   each context-parallel rank keeps its zigzag share of every per-token field
   (the recorded routes too); under expert parallelism or HSDP, whose forwards
   hold collectives, a rank with fewer micro-batches than its peers runs
   filler micro-batches first (`batches.filler_batch`);
3. with `--ppo-mini-batches N > 1`: the step's groups split into N
   mini-batches, the old log-probs of every token computed once under the
   weights before the first update (so the ratio departs from 1 after it);
4. `Trainer.train_step` (one update per mini-batch, then the loop state moves
   on once): the policy loss of `--policy-loss` (`policy_losses`), MTP
   self-distillation when the model has MTP, the feedback KL with textual
   feedback; the engine's weights version moves on.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..config.model import ModelConfig
from ..config.training import TrainingConfig
from ..inference.engine import Engine
from ..inference.sampling import token_logprobs
from ..models import build_model, composer_forward
from ..moe.replay import RouterReplayController
from ..parallel import ParallelLayout, zigzag_batch
from ..training.trainer import Trainer, TrainingData
from .algorithms import default_normalizer, group_advantages, kl_estimate, kl_penalized_rewards
from .backends import EngineBackend
from .batches import RolloutSample, filler_batch, pack_samples
from .config import RLConfig
from .environments import build_environment, merge_evaluations
from .feedback import build_rules, feedback_metrics
from .feedback_loss import FeedbackLoss, FeedbackTeacher, TeacherWeights
from .loss import PolicyLoss
from .packing import attention_costs, plan_step
from .reference import build_reference_model
from .rewards import EffortCounts, effort, import_reward_terms, parse_reward_weights, reward_terms, score
from .task_selection import TaskSelector, parse_bounds, trained_groups, zero_signal_groups


class _Scored:
    """What `rewards.score`'s terms read from a sample: its verdict's values as attributes, and its effort."""

    def __init__(self, sample: RolloutSample):
        for name, value in sample.rewards.items():
            setattr(self, name, value)
        self.correctness = sample.rewards.get("correctness", 0.0)
        self.effort_counts = sample.effort or EffortCounts(final_message_tokens=len(sample.completion_ids), turns=1)


def colocated_engine_refusal(tp: int, ep: int, sharding: str = "ddp") -> Optional[str]:
    """Why the colocated engine cannot sample at this layout (None: it can). The engine decodes with the
    rank's own weights, whole; tensor and expert parallelism leave each rank a shard of them, and HSDP
    would all-gather every layer in each decode step, which ranks decoding different prompts for
    different lengths do not run in lockstep. The RL step itself (`train_on`) runs at any layout the CPT
    trainer takes; `--async-rl` samples on inference workers that hold the whole model."""
    if ep != 1:
        return (f"the synchronous loop samples with an engine colocated on every rank, which needs whole "
                f"weights; --expert-model-parallel-size {ep} shards them; add --async-rl (inference workers "
                f"hold the whole model, the trainer ranks keep --expert-model-parallel-size {ep}) or use "
                f"--expert-model-parallel-size 1")
    if tp != 1:
        return (f"the synchronous loop samples with an engine colocated on every rank, which needs whole "
                f"weights; --tensor-model-parallel-size {tp} shards them, and --async-rl does not join TP "
                f"shards either; use --tensor-model-parallel-size 1 and shard the trainer with "
                f"--expert-model-parallel-size and --async-rl, or with --data-parallel-sharding hsdp "
                f"and --async-rl")
    if sharding == "hsdp":
        return ("the synchronous loop samples with an engine colocated on every rank, which needs whole "
                "weights; --data-parallel-sharding hsdp shards them; add --async-rl (inference workers hold "
                "the whole model, the trainer ranks keep --data-parallel-sharding hsdp) or use "
                "--data-parallel-sharding ddp")
    return None


class RLTrainer:
    """The RL update on a composed `Trainer`, with its colocated rollout engine where the layout leaves the
    rank whole weights (`colocated_engine_refusal`; module docstring)."""

    def __init__(self, model_cfg: ModelConfig, layout: ParallelLayout, cfg: TrainingConfig, rl: RLConfig,
                 tokenizer, *, log=None):
        cfg = cfg.with_tokenizer(getattr(tokenizer, "model_path", None))  # checkpoints carry their tokenizer
        self.trainer = t = Trainer(model_cfg, layout, TrainingData(train=None), cfg, log=log)
        self.rl, self.tokenizer = rl, tokenizer
        import_reward_terms(rl.reward.modules)  # in this process too (a Ray actor unpickles rl unchecked)
        self.reward_weights = parse_reward_weights(rl.reward.terms)
        self.reward_terms = reward_terms(rl.reward)
        self.policy_loss = PolicyLoss(rl)
        t.loss_plugins = [self.policy_loss] + [p for p in t.loss_plugins if p.name == "mtp loss"]
        # expert all-to-alls (EP) and FSDP all-gathers (HSDP) in every forward: the data-parallel ranks
        # run the same number of micro-batches, the short ones padded with `filler_batch`es
        self.lockstep = layout.ep > 1 or cfg.data_parallel_sharding == "hsdp"
        t.pre_forward = self._pre_forward
        self.max_len = min(cfg.seq_length, model_cfg.max_position_embeddings)
        self.engine = self.backend = None  # the colocated engine needs whole weights on the rank
        if rl.rollout.backend == "vllm":
            self.backend = self._vllm_backend()
            self.rl = rl = self._replay_for_backend(rl)
        elif rl.rollout.backend == "sglang":
            self.backend = self._sglang_backend()
            self.rl = rl = self._replay_for_backend(rl)
        elif colocated_engine_refusal(layout.tp, layout.ep, cfg.data_parallel_sharding) is None:
            self.engine = Engine(t.model, model_cfg, tokenizer, max_batch_size=rl.rollout.rollout_batch_size,
                                 max_model_len=self.max_len)
            self.backend = EngineBackend(self.engine)
        self.replay = None
        if rl.algorithm.router_replay and model_cfg.num_moe_layers:
            self.replay = RouterReplayController(t.model.module, rl.algorithm.replay_plausibility_threshold)
        self.env = build_environment(rl, tokenizer, self.max_len)
        self.eval_env = None  # built on first use (`evaluate`)
        self._setup_feedback()
        self.linear_cost, self.quadratic_cost = attention_costs(model_cfg)
        self.reference = None
        t.extra_meta["rl_reference"] = cfg.checkpoint.load  # the run's first --load, kept across resumes
        self.selector = None  # --task-selection solve-rate: estimates and cursor, in the checkpoint's meta
        if rl.rollout.task_selection == "solve-rate":
            self.selector = TaskSelector(parse_bounds(rl.rollout.task_solve_rate_bounds))
            t.extra_meta["rl_task_selection"] = self.selector.state_dict()

    # ---- the composed trainer's state, read by the drivers ----------------------------
    model = property(lambda self: self.trainer.model)
    optimizer = property(lambda self: self.trainer.optimizer)
    state = property(lambda self: self.trainer.state)
    cfg = property(lambda self: self.trainer.cfg)
    model_cfg = property(lambda self: self.trainer.model_cfg)
    log = property(lambda self: self.trainer.log)
    checkpoints = property(lambda self: self.trainer.checkpoints)
    device = property(lambda self: self.trainer.device)
    dp_rank = property(lambda self: self.trainer.dp_rank)
    dp_size = property(lambda self: self.trainer.dp_size)
    cp_rank = property(lambda self: self.trainer.cp_rank)
    cp_size = property(lambda self: self.trainer.cp_size)

    @property
    def loss_plugins(self) -> list:
        return self.trainer.loss_plugins

    def _pre_forward(self, batch) -> None:
        """The trainer's `pre_forward`: route this micro-batch's tokens as the sampler did (pad tokens,
        recorded as -1, take the router's own experts; their `padding_mask` keeps them, and a filler's
        tokens, out of the expert-bias counts)."""
        if self.replay is None:
            return
        if getattr(batch, "routed_experts", None) is not None:
            self.replay.set(batch.routed_experts[0])
        else:
            self.replay.clear()

    # ---- the vLLM rollout backend ----------------------------------------------------------
    def _vllm_backend(self):
        """`--rollout-backend vllm` on the weights now in the model (`vllm_backend.start_for_ranks`)."""
        from .vllm_backend import start_for_ranks

        rl = self.rl
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            rl.vllm.dtype or ("bfloat16" if self.cfg.bf16 else "float32")]
        backend, workdir = start_for_ranks(self.model_cfg, rl.vllm, self._policy_weights(dtype), dtype=dtype,
                                           version=self.state.iteration, max_model_len=self.max_len,
                                           routed_experts=rl.algorithm.router_replay, log=self.log.print)
        self.vllm_workdir = workdir
        return backend

    def _sglang_backend(self):
        """`--rollout-backend sglang`: the --sglang-url servers, given the weights now in the model
        (`sglang_backend.start_for_ranks`)."""
        from .sglang_backend import start_for_ranks

        rl = self.rl
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            rl.sglang.dtype or ("bfloat16" if self.cfg.bf16 else "float32")]
        return start_for_ranks(self.model_cfg, rl.sglang, self._policy_weights(dtype), dtype=dtype,
                               version=self.state.iteration, routed_experts=rl.algorithm.router_replay,
                               log=self.log.print)

    def _replay_for_backend(self, rl: RLConfig) -> RLConfig:
        """Router replay off, said once, where the backend does not return routed experts: the trainer's
        routers route every token of every sample (never a mix of replayed and unreplayed samples)."""
        if not (rl.algorithm.router_replay and self.model_cfg.num_moe_layers) or self.backend.capabilities.routed_experts:
            return rl
        self.log.print(f"> router replay off: the {self.backend.name} backend does not return the routed experts "
                       f"(vLLM returns them only from its GPU model runner, SGLang with "
                       f"--enable-return-routed-experts); the "
                       f"trainer's routers route every token (metric 'router replay' 0)")
        return rl.replace(router_replay=False)

    def _policy_weights(self, dtype: Optional[torch.dtype] = None) -> Optional[dict]:
        """The whole policy under checkpoint names on global rank 0 (None elsewhere, and for a backend that
        shares the trainer's tensors); a collective of every rank otherwise."""
        from .async_rl.gather import check_publishable, gather_policy

        if self.backend is not None and self.backend.shares_weights:
            return None
        layout = self.trainer.layout
        check_publishable(layout.tp, layout.pp, layout.etp)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        dtype = dtype or getattr(self.backend, "dtype", torch.float32)
        return gather_policy(self.model, (lambda x: x.to("cpu", dtype, copy=True)) if rank0 else None)

    def publish_weights(self) -> None:
        """The weights after this step into the backend, tagged with the iteration (a backend sharing the
        trainer's tensors only moves its version on); every rank waits for the push."""
        if self.backend is None:
            return
        self.backend.update_weights(self._policy_weights(), version=self.state.iteration)
        if not self.backend.shares_weights and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def close(self) -> None:
        """Stop what the trainer started beside it (a vLLM server)."""
        import shutil

        if self.backend is not None and not self.backend.shares_weights:
            self.backend.close()
        if getattr(self, "vllm_workdir", None):
            shutil.rmtree(self.vllm_workdir, ignore_errors=True)

    def _setup_feedback(self) -> None:
        """Textual feedback (`--feedback-rules`): the rules, and with a coefficient the teacher and the loss."""
        rl, t = self.rl, self.trainer
        self.feedback_rules = build_rules(rl, client=self.backend, tokenizer=self.tokenizer)
        self.env.set_feedback_rules(self.feedback_rules)
        self.feedback_teacher = None
        if not (self.feedback_rules and rl.feedback.coef):
            return
        if t.cp_size > 1:
            raise ValueError(f"--feedback-rules with a coefficient needs whole teacher contexts on a rank; "
                             f"--context-parallel-size {t.cp_size} splits them; use 1, or --feedback-coef 0 "
                             "to count the mistakes only")
        t.loss_plugins.insert(1, FeedbackLoss(rl.feedback.kl, rl.feedback.coef))
        build_copy = lambda: build_model(t.model_cfg, t.layout, seq_length=t.cfg.seq_length)  # noqa: E731
        weights = TeacherWeights(t.model, rl.feedback.teacher, rl.feedback.teacher_lag, build_copy, t.device,
                                 before_forward=self.replay.clear if self.replay is not None else None)
        self.feedback_teacher = FeedbackTeacher(weights, rl.feedback.kl_topk, rl.algorithm.micro_batch_tokens)

    # ---- start-up -----------------------------------------------------------------------
    def build_reference(self) -> None:
        """The frozen reference model for the KL: the weights RL started from, at the policy's layout (under
        HSDP sharded like the policy), in host memory between steps with --reference-offload
        (`rl/reference.py`)."""
        if not self.rl.algorithm.kl_coef:
            return
        self.reference = build_reference_model(self.trainer, self.trainer.extra_meta.get("rl_reference"),
                                               self.rl.algorithm.reference_offload)

    def resume(self) -> None:
        """--load (weights only from an SFT checkpoint, everything from an RL run), then the reference; a
        backend with weights of its own gets the loaded ones."""
        self.trainer.resume()
        if self.selector is not None:  # a resumed RL run continues its estimates and cursor
            self.selector.load_state_dict(self.trainer.extra_meta["rl_task_selection"])
        self.build_reference()
        if self.backend is not None and not self.backend.shares_weights:
            self.publish_weights()

    # ---- rollouts of the synchronous driver ------------------------------------------
    def group_ids(self, iteration: int) -> list[int]:
        """The global group ids of step `iteration` (`rollout` module docstring)."""
        k = self.rl.rollout.prompts_per_step
        return list(range(iteration * k, (iteration + 1) * k))

    def rollouts(self, iteration: int) -> list[RolloutSample]:
        """Step `iteration`'s samples from the colocated engine: each data-parallel rank runs its share of the
        groups (their episodes' turns meet in the engine's batch), then every rank holds all of them, as
        step-local groups 0 .. prompts_per_step - 1."""
        import concurrent.futures

        self._need_engine()
        ids = self.group_ids(iteration)
        chosen = self.selector.choose(self.env, len(ids)) if self.selector is not None else None
        if chosen is not None:
            self.env.assign_tasks(dict(zip(ids, chosen)))
        mine = [j for j in range(len(ids)) if j % self.dp_size == self.dp_rank]
        self.model.eval()
        self.backend.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(max(1, len(mine))) as pool:
                runs = list(pool.map(lambda j: self.env.run_group(
                    self.backend, ids[j], self.env.seeds(self.cfg.seed, ids[j])), mine))
        finally:
            self.backend.stop()
            self.model.train()
        size = self.rl.rollout.group_size
        samples = [dataclasses.replace(s, group=j, trajectory=j * size + s.trajectory % size)
                   for j, run in zip(mine, runs) for s in run]
        samples = self._gather(samples)
        if chosen is not None:
            self.selector.observe(self.env, chosen, samples)
            self.trainer.extra_meta["rl_task_selection"] = self.selector.state_dict()
        return samples

    @property
    def selection_metrics(self) -> dict:
        """The last step's task-selection metrics (none without --task-selection solve-rate)."""
        return dict(self.selector.metrics) if self.selector is not None else {}

    def _need_engine(self) -> None:
        if self.backend is None:
            raise ValueError(colocated_engine_refusal(self.trainer.layout.tp, self.trainer.layout.ep,
                                                      self.trainer.cfg.data_parallel_sharding))

    def _gather(self, samples: list[RolloutSample]) -> list[RolloutSample]:
        """All ranks' samples, each group once, in group order."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, samples)
            by_group: dict[int, list] = {}
            for part in gathered:  # context-parallel peers sampled the same groups: keep one copy
                here: dict[int, list] = {}
                for s in part:
                    here.setdefault(s.group, []).append(s)
                for g, group in here.items():
                    by_group.setdefault(g, group)
            samples = [s for g in sorted(by_group) for s in by_group[g]]
        return sorted(samples, key=lambda s: s.group)

    # ---- one RL step on a step's samples (both drivers) -----------------------------------------
    def _forward_logprobs(self, model, batch) -> torch.Tensor:
        """[1, T] log-probs (at the sampling temperature) of a host batch's labels under `model`, no grad."""
        device_batch = batch.to(self.device)
        with torch.no_grad():
            if model is None:
                logits = self.trainer.forward(device_batch).logits
            else:
                logits, _ = composer_forward(model, device_batch.tokens, device_batch.position_ids,
                                             device_batch.packed_seq_params)
            logp = token_logprobs(logits[0], device_batch.labels[0], self.rl.rollout.temperature)
        return logp.cpu()[None]

    def _pack(self, samples: list[RolloutSample], members_of: list[int]) -> list[tuple]:
        """(sample indices, this rank's CP share of the packed micro-batch) for the samples `members_of`,
        balanced across data-parallel ranks."""
        rl = self.rl
        plan = plan_step([samples[i].length for i in members_of], self.dp_size, rl.algorithm.micro_batch_tokens,
                         self.linear_cost, self.quadratic_cost)
        bins, out = plan[self.dp_rank], []
        if self.lockstep:
            if not bins:
                raise ValueError(
                    f"a mini-batch of {len(members_of)} samples leaves data-parallel rank {self.dp_rank} of "
                    f"{self.dp_size} none, and under expert parallelism or HSDP every rank runs each forward; "
                    f"raise --prompts-per-step or --group-size, or lower --ppo-mini-batches")
            filler = zigzag_batch(filler_batch(2 * self.cp_size), self.cp_size, self.cp_rank)
            empty = torch.zeros(0, dtype=torch.long)
            out = [(empty, filler)] * (max(map(len, plan)) - len(bins))
        for local in bins:
            members = [members_of[i] for i in local]
            batch = zigzag_batch(pack_samples([samples[i] for i in members]), self.cp_size, self.cp_rank,
                                 pad_to_multiple=True)
            if self.feedback_teacher is not None:
                batch = self.feedback_teacher.annotate(batch, [samples[i] for i in members])
            out.append((torch.tensor(members, dtype=torch.long), batch))
        return out

    def prepare(self, samples: list[RolloutSample]) -> tuple[list[list], dict]:
        """Score, pack and CP-split this rank's share, KL and advantages (steps 1-2 of the module docstring);
        returns (the mini-batches, each this rank's micro-batches, and the step's metrics)."""
        rl = self.rl
        count = rl.rollout.prompts_per_step * rl.rollout.group_size
        heads: dict[int, RolloutSample] = {}  # each trajectory's first sample carries its verdict
        for s in samples:
            heads.setdefault(s.trajectory, s)
        if sorted(heads) != list(range(count)):
            raise RuntimeError(f"internal: the step has trajectories {sorted(heads)[:8]}..., expected 0..{count - 1}")
        trajectories = [heads[t] for t in range(count)]
        totals, per_term = score([_Scored(s) for s in trajectories], self.reward_weights, self.reward_terms)
        owner = torch.tensor([s.trajectory for s in samples])  # sample -> its trajectory
        groups_per_mini = rl.rollout.prompts_per_step // rl.algorithm.ppo_mini_batches
        zero = zero_signal_groups(totals.double().view(rl.rollout.prompts_per_step, rl.rollout.group_size))
        trained = set(range(len(zero)))
        if rl.algorithm.drop_zero_signal_groups:  # under EP or HSDP enough groups for a sample on every rank
            trained = set(trained_groups(zero, groups_per_mini, -(-self.dp_size // rl.rollout.group_size)
                                         if self.lockstep else 1))
        if self.feedback_teacher is not None:
            self.feedback_teacher.logits_fn.refresh(self.state.iteration)
        minis = [self._pack(samples, [i for i, s in enumerate(samples)
                                      if s.group // groups_per_mini == j and s.group in trained])
                 for j in range(rl.algorithm.ppo_mini_batches)]
        kl_sums = torch.zeros(count, dtype=torch.float64)  # per trajectory
        if self.reference is not None:
            with self.reference.resident() as reference:  # on the device for these forwards only
                for members, batch in (mb for mini in minis for mb in mini):
                    batch.ref_logp = self._forward_logprobs(reference, batch)
                    if batch.filler:
                        continue
                    kl = kl_estimate(batch.sampler_logp, batch.ref_logp, rl.algorithm.kl_kind) * batch.loss_mask
                    kl_sums.index_add_(0, owner[members][batch.segment_ids[0]], kl[0].double())
            self._all_reduce_dp_cp(kl_sums)  # each token lives on one (DP, CP) rank
        rewards = totals.double()
        if rl.algorithm.kl_coef and rl.algorithm.kl_placement == "reward":
            rewards = kl_penalized_rewards(rewards, kl_sums, rl.algorithm.kl_coef)
        advantages = group_advantages(rewards.view(rl.rollout.prompts_per_step, rl.rollout.group_size), rl.algorithm.advantage).reshape(-1)
        for s in samples:
            s.reward, s.advantage = float(rewards[s.trajectory]), float(advantages[s.trajectory])
        normalizer = default_normalizer(groups_per_mini * rl.rollout.group_size, rl.trajectory_tokens)
        placed = []
        for mini in minis:
            micro = []
            for index, (members, batch) in enumerate(mini):
                if not batch.filler:
                    sample_advantages = advantages[owner[members]].float()
                    batch.advantages = batch.loss_mask * sample_advantages[batch.segment_ids[0]][None]
                first = index == 0 and self.dp_rank == 0 and self.cp_rank == 0
                micro.append(dataclasses.replace(batch, normalizer_share=normalizer if first else 0.0))
            placed.append(micro)
        metrics = self._step_metrics(samples, trajectories, totals, per_term, advantages, kl_sums)
        metrics.update({"zero-signal groups": float(zero.sum()), "dropped groups": float(len(zero) - len(trained))})
        return placed, metrics

    def _all_reduce_dp_cp(self, t: torch.Tensor) -> torch.Tensor:
        return self.trainer._all_reduce_dp_cp(t)

    def _step_metrics(self, samples, trajectories, totals, per_term, advantages, kl_sums) -> dict:
        count = len(trajectories)
        generated = torch.zeros(count)
        for s in samples:
            generated[s.trajectory] += len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask)
        metrics = {"reward": float(totals.mean()), "advantage abs": float(advantages.abs().mean()),
                   "completion length": float(generated.mean()),
                   "truncated fraction": sum(s.finish_reason in ("length", "max_turns", "token_budget", "context")
                                             for s in trajectories) / count}
        metrics.update({f"reward {name}": float(v.mean()) for name, v in per_term.items()})
        weights = self.rl.reward.effort_weights  # the effort x the length penalty reads, logged with or without it
        metrics["effort"] = sum(effort(_Scored(s).effort_counts, weights) for s in trajectories) / count
        for key in sorted({k for s in trajectories for k in s.rewards}):  # the task's own verdicts
            metrics[f"task {key}"] = sum(s.rewards.get(key, 0.0) for s in trajectories) / count
        for key in sorted({k for s in trajectories for k in s.info}):  # agentic: turns, summaries, ...
            metrics[key] = sum(s.info.get(key, 0.0) for s in trajectories) / count
        if self.feedback_rules:
            turns = sum(s.info.get("turns", 0.0) for s in trajectories)
            metrics.update(feedback_metrics(samples, count, list(self.feedback_rules), turns))
        if self.reference is not None:
            metrics["kl to reference"] = float(kl_sums.sum() / generated.sum().clamp(min=1))
        return metrics

    def train_on(self, samples: list[RolloutSample]) -> dict:
        """One RL step on a step's samples (groups 0 .. prompts_per_step - 1, trajectories numbered
        group * group_size + index, every rank the same list): steps 1-4 of the module docstring."""
        started = time.perf_counter()
        minis, metrics = self.prepare(samples)
        if len(minis) > 1 or self.policy_loss.needs_old_logp:
            for batch in (b for mini in minis for b in mini):  # the weights before the first update
                batch.old_logp = self._forward_logprobs(None, batch)
        results = [self.trainer.update(mini) for mini in minis]
        self.trainer.advance(any(not r.skipped for r in results), len(samples))
        self.publish_weights()
        metrics.update(self.policy_loss.pop_stats())
        metrics["router replay"] = float(self.replay is not None)
        if self.replay is not None:
            metrics["replaced experts"] = self._replaced_fraction()
        if self.backend is not None:
            metrics.update(self.backend.metrics())
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731 - over the step's updates
        metrics.update({"policy loss": mean([r.losses["policy loss"] for r in results]),
                        "grad norm": mean([r.grad_norm for r in results]), "lr": results[-1].lr,
                        "updates": float(len(results)), "train seconds": time.perf_counter() - started,
                        "skipped": float(sum(r.skipped for r in results))})
        for name in ("mtp loss", "feedback kl"):
            if name in results[0].losses:
                metrics[name] = mean([r.losses[name] for r in results])
        return metrics

    def _replaced_fraction(self) -> float:
        """The fraction of replayed experts the plausibility filter replaced in this step, over every
        rank's tokens (each token is replayed on the one (DP, CP) rank that holds it)."""
        counts = torch.tensor([[r.replaced, r.replayed] for r in self.replay.replays], dtype=torch.float64).sum(0)
        self._all_reduce_dp_cp(counts)
        self.replay.replaced_fraction()  # reset the counts
        return float(counts[0] / counts[1]) if counts[1] else 0.0

    # ---- held-out evaluation (synchronous driver) -----------------------------------------
    def evaluate(self) -> Optional[dict]:
        """Greedy episodes of `--eval-tasks` held-out tasks (`--eval-task-file`: also pass@k) on the colocated engine (data-parallel ranks
        split them; every rank returns the same numbers), or None where the environment has none."""
        rl = self.rl
        if not (rl.rollout.eval_tasks or rl.environment.eval_task_file):
            return None
        self._need_engine()
        if self.eval_env is None:
            self.eval_env = build_environment(rl, self.tokenizer, self.max_len, split="eval",
                                              count=rl.rollout.eval_tasks or None)
        self.model.eval()
        self.backend.start()
        try:
            part = self.eval_env.evaluate(self.backend, workers=rl.environment.episode_workers,
                                          shard=(self.dp_rank, self.dp_size))
        finally:
            self.backend.stop()
            self.model.train()
        if part is None:
            return None
        parts = {self.dp_rank: part}
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (self.dp_rank, part))
            parts = dict(gathered)  # context-parallel peers evaluated the same share: one copy each
        return merge_evaluations([parts[r] for r in sorted(parts)])
