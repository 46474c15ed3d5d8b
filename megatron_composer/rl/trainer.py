"""Synchronous RL on the shared training loop: sample groups, score, pack, one policy update.

    trainer = RLTrainer(model_cfg, layout, TrainingConfig(...), RLConfig(...), tokenizer)
    trainer.resume()   # --load: an SFT checkpoint (weights only) or an RL run (everything)
    trainer.train()

One RL step (`rl_step`):

1. prompts: the next `prompts_per_step` of the task, in order (each used
   once per pass), rendered with the chat template;
2. rollouts: the in-process `inference.Engine` shares the trainer's weights
   and generates `group_size` samples per prompt with per-sample seeds,
   returning log-probs and routed experts; each data-parallel rank samples
   its share of the groups and the samples are all-gathered;
3. rewards: the task's verdict and the other `--reward` terms (`rewards.score`),
   optionally minus kl_coef * sum of per-token KL to the frozen reference
   model (`--kl-placement reward`); advantages per group (`--advantage`);
4. packing: `packing.plan_step` balances the samples' cost (attention's
   quadratic term from the model shape) across data-parallel ranks, then
   cuts each rank's share into micro-batches of at most `micro_batch_tokens`;
5. the shared `Trainer.step()` with the policy-loss plug-in (and MTP
   self-distillation when the model has MTP), router replay forcing the
   engine's experts (`moe.replay`), then the engine's weights version moves on.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..config.model import ModelConfig
from ..config.training import TrainingConfig
from ..data.sft import render_chat
from ..inference import SamplingParams
from ..inference.engine import Engine
from ..models import build_model, composer_forward
from ..moe.replay import RouterReplayController
from ..parallel import ParallelLayout, zigzag_batch
from ..training.trainer import Trainer, TrainingData
from .algorithms import default_normalizer, group_advantages, kl_estimate, kl_penalized_rewards
from .batches import RolloutSample, pack_samples
from .config import RLConfig
from .feedback import attach_hints, build_rules, feedback_metrics
from .feedback_loss import FeedbackLoss, FeedbackTeacher, TeacherWeights
from .loss import PolicyLoss
from .packing import attention_costs, plan_step
from .rewards import REWARD_TERMS, EffortCounts, LengthPenaltyConfig, length_term, parse_reward_weights, score
from .agent import known_ids, system_prompt
from .tasks import get_task


class _Scored:
    """What `rewards.score`'s terms read from a sample: its verdict's values as attributes, and its effort."""

    def __init__(self, sample: RolloutSample):
        for name, value in sample.rewards.items():
            setattr(self, name, value)
        self.correctness = sample.rewards.get("correctness", 0.0)
        self.effort_counts = sample.effort or EffortCounts(final_message_tokens=len(sample.completion_ids), turns=1)


def episode_samples(results, groups: list[int], group_size: int, tokenizer, rules: Optional[dict] = None,
                    hint_role: str = "user") -> list[RolloutSample]:
    """Agent episodes (`agentic.EpisodeResult`, in group order, `group_size` per group; `groups[j]` is
    result j's group) as training samples: one per segment of each trajectory, with the feedback
    `rules`' hints on the segments they target."""
    samples, seen = [], {}
    for result, g in zip(results, groups):
        i = seen[g] = seen.get(g, -1) + 1
        traj = result.trajectory
        info = {"turns": traj.counts.turns, "summaries": len(traj.summaries),
                "summary tokens": sum(len(tokenizer.encode(x)) for x in traj.summaries),
                "finished": float(traj.finished), "generated tokens": traj.generated_tokens,
                "tool calls": traj.counts.tool_calls}
        for seg in traj.segments:
            samples.append(RolloutSample(
                g, seg.prompt_ids, seg.completion_ids, seg.logprobs, seg.padded_routes(), seg.policy_versions,
                traj.stop_reason, traj.final_message or "", rewards=dict(result.verdict),
                trajectory=g * group_size + i, loss_mask=seg.trained, effort=traj.counts, info=info))
        if rules:
            attach_hints(traj, samples[len(samples) - len(traj.segments):], rules, tokenizer, hint_role)
    return samples


def agent_config(rl: RLConfig, max_len: int, *, routed_experts: bool, **overrides):
    """The `agent.AgentConfig` of train_rl.py's flags for a context of `max_len` tokens."""
    from .agent import AgentConfig

    config = AgentConfig(max_turns=rl.max_turns, max_turn_tokens=rl.max_new_tokens, max_context_tokens=max_len,
                         max_total_tokens=rl.token_budget, max_observation_tokens=rl.max_observation_tokens,
                         summary_trigger_tokens=rl.summary_trigger_tokens, max_summaries=rl.max_summaries,
                         summary_max_tokens=rl.summary_max_tokens, temperature=rl.temperature, top_p=rl.top_p,
                         return_routed_experts=routed_experts)
    return dataclasses.replace(config, **overrides)


def fitting_prompts(rl: RLConfig, task, tokenizer, max_len: int) -> list:
    """(prompt, rendered ids) of the single-turn task's prompts that leave room for a completion."""
    room = max_len - rl.max_new_tokens
    fitting = []
    for prompt in task.prompts():
        ids = render_chat(list(prompt.messages), tokenizer, add_generation_prompt=True)[0]
        if len(ids) <= room:
            fitting.append((prompt, ids))
    if not fitting:
        raise ValueError(f"no {rl.task} prompt fits --seq-length {max_len} with --max-new-tokens "
                         f"{rl.max_new_tokens}; raise --seq-length or lower --max-new-tokens")
    return fitting


def fitting_tasks(rl: RLConfig, env, agent, max_len: int) -> list:
    """The env's tasks whose first prompt leaves room for a turn (each is a group's task)."""
    room = max_len - rl.max_new_tokens
    fitting = [t for t in env.tasks() if len(agent.segment_prompt(
        system_prompt(env.tool_names), t.instruction, None)) <= room]
    if not fitting:
        raise ValueError(f"no {','.join(env.families)} task fits --seq-length {max_len} with --max-new-tokens "
                         f"{rl.max_new_tokens}; raise --seq-length or lower --max-new-tokens")
    return fitting


def completion_sample(group: int, trajectory: int, completion, tokenizer, task, prompt) -> RolloutSample:
    """One single-turn completion as a sample, scored by `task.verify` on its text (stop tokens dropped)."""
    tok = tokenizer
    text = tok.decode([t for t in known_ids(tok, completion.token_ids) if t not in (tok.chat["end"], tok.eod)])
    return RolloutSample(group, completion.prompt_token_ids, completion.token_ids, completion.logprobs,
                         completion.routed_experts, completion.policy_versions, completion.finish_reason, text,
                         rewards=task.verify(prompt, text), trajectory=trajectory)


class RLTrainer(Trainer):
    """The Trainer with rollouts from a colocated engine as its data and the policy loss as its objective."""

    def __init__(self, model_cfg: ModelConfig, layout: ParallelLayout, cfg: TrainingConfig, rl: RLConfig,
                 tokenizer, *, log=None):
        for flag, size in (("--tensor-model-parallel-size", layout.tp), ("--expert-model-parallel-size", layout.ep)):
            if size != 1:
                raise ValueError(f"train_rl.py samples with an engine colocated on every rank, which holds whole "
                                 f"weights; {flag} {size} shards them; use {flag} 1 (data and context "
                                 f"parallelism work)")
        super().__init__(model_cfg, layout, TrainingData(train=None), cfg, log=log)
        self.rl, self.tokenizer = rl, tokenizer
        self.task = get_task(rl.task)
        self.reward_weights = parse_reward_weights(rl.reward)
        self.reward_terms = {**REWARD_TERMS, "length": length_term(
            LengthPenaltyConfig(k=rl.length_penalty_k, q=rl.length_penalty_q))}
        self.policy_loss = PolicyLoss(rl)
        self.loss_plugins = [self.policy_loss] + [p for p in self.loss_plugins if p.name == "mtp loss"]
        self.replay = None
        if rl.router_replay and model_cfg.num_moe_layers:
            self.replay = RouterReplayController(self.model.module, rl.replay_plausibility_threshold)
        max_len = min(cfg.seq_length, model_cfg.max_position_embeddings)
        self.engine = Engine(self.model, model_cfg, tokenizer, max_batch_size=rl.rollout_batch_size,
                             max_model_len=max_len)
        self.env = self.agent = None
        if rl.env == "agentic-coding":
            from .agent import Agent
            from .agentic import AgenticCodingEnv

            self.sandbox_kwargs = {"timeout_s": rl.sandbox_timeout_s}
            self.env = AgenticCodingEnv(rl.families, split="train", sandbox_kwargs=self.sandbox_kwargs)
            self.agent_config = agent_config(rl, max_len, routed_experts=self.replay is not None)
            self.agent = Agent(self.engine, tokenizer, self.agent_config)
            self.prompts = fitting_tasks(rl, self.env, self.agent, max_len)
        else:
            self.prompts = fitting_prompts(rl, self.task, tokenizer, max_len)
        self._setup_feedback()
        self.linear_cost, self.quadratic_cost = attention_costs(model_cfg)
        self.reference = None
        self.reference_path: Optional[str] = cfg.checkpoint.load
        self._rl_batches: list = []
        self.checkpoint_files: dict[str, bytes] = {}  # saved inside every checkpoint (async RL: the buffer)
        self.history: list[dict] = []
        self.eval_history: list[dict] = []

    def _setup_feedback(self) -> None:
        """Textual feedback (`--feedback-rules`): the rules, and with a coefficient the teacher and the loss."""
        rl = self.rl
        self.feedback_rules = build_rules(rl, client=self.engine, tokenizer=self.tokenizer)
        self.feedback_teacher = None
        if not (self.feedback_rules and rl.feedback_coef):
            return
        if self.cp_size > 1:
            raise ValueError(f"--feedback-rules with a coefficient needs whole teacher contexts on a rank; "
                             f"--context-parallel-size {self.cp_size} splits them; use 1, or --feedback-coef 0 "
                             "to count the mistakes only")
        self.loss_plugins.insert(1, FeedbackLoss(rl.feedback_kl, rl.feedback_coef))
        build_copy = lambda: build_model(self.model_cfg, self.layout, seq_length=self.cfg.seq_length)  # noqa: E731
        weights = TeacherWeights(self.model, rl.feedback_teacher, rl.feedback_teacher_lag, build_copy, self.device,
                                 before_forward=self.replay.clear if self.replay is not None else None)
        self.feedback_teacher = FeedbackTeacher(weights, rl.feedback_kl_topk, rl.micro_batch_tokens)

    # ---- state --------------------------------------------------------------
    def state_dict(self) -> dict:
        return dict(super().state_dict(), rl_reference=self.reference_path)

    def extra_checkpoint_files(self) -> dict[str, bytes]:
        return dict(self.checkpoint_files)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.reference_path = state.get("rl_reference", self.reference_path)

    def build_reference(self) -> None:
        """The frozen reference model for the KL: the weights RL started from."""
        if not self.rl.kl_coef:
            return
        ref = build_model(self.model_cfg, self.layout, seq_length=self.cfg.seq_length).to(self.device)
        if self.reference_path:
            from ..checkpoint import load_checkpoint
            from ..checkpoint.tracker import latest_iteration

            root = self.reference_path
            load_checkpoint(root, ref, iteration=latest_iteration(root), allow_missing=("mtp.",),
                            verify=self.cfg.checkpoint.verify_checkpoint)
        else:
            ref.load_state_dict(self.model.module.state_dict())
        for p in ref.parameters():
            p.requires_grad_(False)
        self.reference = ref.eval()

    def resume(self) -> None:
        super().resume()
        self.build_reference()

    # ---- one RL step --------------------------------------------------------
    def micro_batches(self, consumed_samples: int, dataset=None):
        return self._rl_batches

    def forward(self, batch):
        if self.replay is not None:
            if batch.routed_experts is not None:
                self.replay.set(batch.routed_experts[0])
            else:
                self.replay.clear()
        return super().forward(batch)

    def _step_prompts(self, iteration: int) -> list:
        n, k = len(self.prompts), self.rl.prompts_per_step
        return [self.prompts[(iteration * k + i) % n] for i in range(k)]

    def _seed(self, iteration: int, group: int, index: int) -> int:
        rl = self.rl
        return (self.cfg.seed * 1_000_003 + iteration * 10_007 + group * rl.group_size + index) % (2 ** 63)

    def _agentic_samples(self, iteration: int, mine: list[int]) -> list[RolloutSample]:
        """This rank's groups as agent episodes: one sample per segment of each trajectory."""
        rl, tasks = self.rl, self._step_prompts(iteration)
        jobs = [(tasks[g], self._seed(iteration, g, i)) for g in mine for i in range(rl.group_size)]
        self.engine.start()  # the episodes' threads meet in the engine's batch
        try:
            results = self.env.episodes(self.agent, jobs, max_workers=rl.episode_workers)
        finally:
            self.engine.stop()
        return episode_samples(results, [g for g in mine for _ in range(rl.group_size)], rl.group_size,
                               self.tokenizer, self.feedback_rules, rl.feedback_hint_role)

    def rollouts(self, iteration: int) -> list[RolloutSample]:
        """Every group of this step (this DP rank samples its share; all ranks get all)."""
        rl, tok = self.rl, self.tokenizer
        self.model.eval()
        mine = [g for g in range(rl.prompts_per_step) if g % self.dp_size == self.dp_rank]
        if self.env is not None:
            samples = self._agentic_samples(iteration, mine)
            self.model.train()
            return self._gather(samples)
        prompts = self._step_prompts(iteration)
        handles = []
        for g in mine:
            prompt, ids = prompts[g]
            for i in range(rl.group_size):
                seed = self._seed(iteration, g, i)
                params = SamplingParams(max_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                                        seed=seed, stop_token_ids=(tok.chat["end"], tok.eod), logprobs=True,
                                        return_routed_experts=self.replay is not None)
                handles.append((g, prompt, self.engine.add_request(ids, params)))
        while self.engine.has_unfinished():
            self.engine.step()
        samples = []
        for g, prompt, handle in handles:
            index = len([s for s in samples if s.group == g])
            samples.append(completion_sample(g, g * rl.group_size + index, handle.result(), tok, self.task, prompt))
        self.model.train()
        return self._gather(samples)

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

    def _reference_logp(self, batch) -> torch.Tensor:
        device_batch = batch.to(self.device)
        with torch.no_grad():
            logits, _ = composer_forward(self.reference, device_batch.tokens, device_batch.position_ids,
                                         device_batch.packed_seq_params)
            logp = -torch.nn.functional.cross_entropy(logits[0].float(), device_batch.labels[0], reduction="none")
        return logp.cpu()[None]

    def _prepare_batches(self, samples: list[RolloutSample]) -> dict:
        """Score, pack and CP-split this rank's share, compute KL and advantages; returns metrics."""
        rl = self.rl
        count = rl.prompts_per_step * rl.group_size
        heads: dict[int, RolloutSample] = {}  # each trajectory's first sample carries its verdict
        for s in samples:
            heads.setdefault(s.trajectory, s)
        if sorted(heads) != list(range(count)):
            raise RuntimeError(f"internal: the step has trajectories {sorted(heads)[:8]}..., expected 0..{count - 1}")
        trajectories = [heads[t] for t in range(count)]
        totals, per_term = score([_Scored(s) for s in trajectories], self.reward_weights, self.reward_terms)
        owner = torch.tensor([s.trajectory for s in samples])  # sample -> its trajectory
        bins = plan_step([s.length for s in samples], self.dp_size, rl.micro_batch_tokens,
                         self.linear_cost, self.quadratic_cost)[self.dp_rank]
        # this rank's context-parallel share of each micro-batch; every per-token field is split alike
        batches = [(torch.tensor(members), zigzag_batch(pack_samples([samples[i] for i in members]), self.cp_size,
                                                        self.cp_rank, pad_to_multiple=True)) for members in bins]
        if self.feedback_teacher is not None:
            self.feedback_teacher.logits_fn.refresh(self.state.iteration)
            batches = [(m, self.feedback_teacher.annotate(b, [samples[i] for i in m.tolist()])) for m, b in batches]
        kl_sums = torch.zeros(count, dtype=torch.float64)  # per trajectory
        if self.reference is not None:
            for members, batch in batches:
                batch.ref_logp = self._reference_logp(batch)
                kl = kl_estimate(batch.sampler_logp, batch.ref_logp, rl.kl_kind) * batch.loss_mask
                kl_sums.index_add_(0, owner[members][batch.segment_ids[0]], kl[0].double())
            if dist.is_initialized() and dist.get_world_size() > 1:
                from megatron.core import parallel_state

                # each token lives on one (DP, CP) rank
                dist.all_reduce(kl_sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        rewards = totals.double()
        if rl.kl_coef and rl.kl_placement == "reward":
            rewards = kl_penalized_rewards(rewards, kl_sums, rl.kl_coef)
        advantages = group_advantages(rewards.view(rl.prompts_per_step, rl.group_size), rl.advantage).reshape(-1)
        for s in samples:
            s.reward, s.advantage = float(rewards[s.trajectory]), float(advantages[s.trajectory])
        normalizer = default_normalizer(rl.prompts_per_step, rl.trajectory_tokens)
        self._rl_batches = []
        for index, (members, batch) in enumerate(batches):
            sample_advantages = advantages[owner[members]].float()
            batch.advantages = batch.loss_mask * sample_advantages[batch.segment_ids[0]][None]
            first = index == 0 and self.dp_rank == 0 and self.cp_rank == 0
            self._rl_batches.append(dataclasses.replace(batch, normalizer_share=normalizer if first else 0.0))
        generated = torch.zeros(count)
        for s in samples:
            generated[s.trajectory] += len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask)
        metrics = {"reward": float(totals.mean()), "advantage abs": float(advantages.abs().mean()),
                   "completion length": float(generated.mean()),
                   "truncated fraction": sum(s.finish_reason in ("length", "max_turns", "token_budget", "context")
                                             for s in trajectories) / count}
        metrics.update({f"reward {name}": float(v.mean()) for name, v in per_term.items()})
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

    def rl_step(self) -> dict:
        """One RL step (module docstring); returns the step's metrics."""
        started = time.perf_counter()
        samples = self.rollouts(self.state.iteration)
        rollout_seconds = time.perf_counter() - started
        metrics = self.train_on(samples)
        metrics.update({"rollout seconds": rollout_seconds, "step seconds": time.perf_counter() - started})
        return metrics

    def train_on(self, samples: list[RolloutSample]) -> dict:
        """Score, pack and take one policy update on a step's samples (groups 0 .. prompts_per_step - 1,
        trajectories numbered group * group_size + index, every rank the same list); the metrics."""
        started = time.perf_counter()
        metrics = self._prepare_batches(samples)
        if not any(b.normalizer_share for b in self._rl_batches) and self.dp_rank == 0 and self.cp_rank == 0:
            raise RuntimeError("internal: the loss normalizer was not placed on any micro-batch")
        result = self.step()
        self.engine.update_weights(None, version=self.state.iteration)  # shared weights: a new version
        metrics.update(self.policy_loss.pop_stats())
        if self.replay is not None:
            metrics["replaced experts"] = self.replay.replaced_fraction()
        metrics.update({"policy loss": result.losses["policy loss"], "grad norm": result.grad_norm,
                        "lr": result.lr, "train seconds": time.perf_counter() - started,
                        "skipped": float(result.skipped)})
        for name in ("mtp loss", "feedback kl"):
            if name in result.losses:
                metrics[name] = result.losses[name]
        return metrics

    # ---- held-out evaluation ---------------------------------------------
    def evaluate(self) -> Optional[dict]:
        """Greedy episodes on `eval_tasks` held-out tasks (agentic env): solved fraction and more.

        Data-parallel ranks split the tasks; every rank returns the same numbers.
        """
        rl = self.rl
        if self.env is None or not rl.eval_tasks:
            return None
        from .agent import Agent
        from .agentic import AgenticCodingEnv

        if getattr(self, "_eval_env", None) is None:
            self._eval_env = AgenticCodingEnv(rl.families, split="eval", count=rl.eval_tasks,
                                              sandbox_kwargs=self.sandbox_kwargs)
        tasks = self._eval_env.tasks()
        agent = Agent(self.engine, self.tokenizer, dataclasses.replace(self.agent_config, temperature=0.0))
        mine = list(range(self.dp_rank, len(tasks), self.dp_size))
        self.model.eval()
        self.engine.start()
        try:
            results = self._eval_env.episodes(agent, [(tasks[i], i) for i in mine], max_workers=rl.episode_workers)
        finally:
            self.engine.stop()
            self.model.train()
        rows = {i: (r.verdict["all_pass"], r.verdict["correctness"], r.trajectory.counts.turns,
                    len(r.trajectory.summaries)) for i, r in zip(mine, results)}
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rows)
            rows = {i: row for part in gathered for i, row in part.items()}
        values = torch.tensor([rows[i] for i in sorted(rows)], dtype=torch.float64).mean(0).tolist()
        return dict(zip(("eval solved", "eval correctness", "eval turns", "eval summaries"), values),
                    **{"eval tasks": float(len(rows))})

    def _log_eval(self) -> None:
        result = self.evaluate()
        if result is not None:
            self.eval_history.append(dict(result, iteration=self.state.iteration))
            self.log.print(f"> eval at step {self.state.iteration}: solved {result['eval solved']:.3f} of "
                           f"{int(result['eval tasks'])} held-out tasks, correctness {result['eval correctness']:.3f}, "
                           f"{result['eval turns']:.2f} turns")

    # ---- the outer loop -----------------------------------------------------
    def train(self):
        cfg, st = self.cfg, self.state
        if cfg.checkpoint.save:
            self.checkpoints.prepare_save_dir()
        if st.iteration < cfg.train_iters:
            self._log_eval()  # where RL starts
        while st.iteration < cfg.train_iters:
            metrics = self.rl_step()
            self.history.append(dict(metrics, iteration=st.iteration))
            self._append_step_log(self.history[-1])
            if self.rl.eval_interval and st.iteration % self.rl.eval_interval == 0 and st.iteration < cfg.train_iters:
                self._log_eval()
            if st.iteration % cfg.log_interval == 0 or st.iteration == cfg.train_iters:
                line = {k: metrics[k] for k in ("reward", "task all_pass", "policy loss", "grad norm",
                                                "completion length", "turns", "summaries", "feedback hints",
                                                "feedback kl", "logp mismatch mean", "step seconds") if k in metrics}
                self.log.log(st.iteration, cfg.train_iters, line, {f"rl/{k}": v for k, v in metrics.items()})
                self.plot_rewards()
            interval = cfg.checkpoint.save_interval
            if cfg.checkpoint.save and interval and st.iteration % interval == 0:
                self.checkpoints.save()
        if cfg.checkpoint.save and not (cfg.checkpoint.save_interval and st.iteration % cfg.checkpoint.save_interval == 0):
            self.checkpoints.save()
        self._log_eval()
        self.plot_rewards()
        return st

    def _append_step_log(self, metrics: dict) -> None:
        """One JSON line per step in --save/rl_steps.jsonl (rank 0): every metric of the step."""
        if not self.cfg.checkpoint.save or (dist.is_initialized() and dist.get_rank() != 0):
            return
        import json

        os.makedirs(self.cfg.checkpoint.save, exist_ok=True)
        with open(os.path.join(self.cfg.checkpoint.save, "rl_steps.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}) + "\n")

    def plot_rewards(self) -> Optional[str]:
        """reward_curve.png in the --save directory (rank 0): mean reward per step and its 10-step mean."""
        if not self.cfg.checkpoint.save or (dist.is_initialized() and dist.get_rank() != 0) or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [h["iteration"] for h in self.history]
        rewards = torch.tensor([h["reward"] for h in self.history])
        window = min(10, len(rewards))
        smooth = torch.nn.functional.avg_pool1d(rewards[None, None], window, 1).flatten()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, rewards.tolist(), alpha=0.4, label="mean reward")
        ax.plot(steps[window - 1:], smooth.tolist(), label=f"{window}-step mean")
        if self.eval_history:
            ax.plot([h["iteration"] for h in self.eval_history], [h["eval solved"] for h in self.eval_history],
                    "o-", label="held-out solved (greedy)")
        ax.set_xlabel("RL step")
        ax.set_ylabel("reward")
        what = self.rl.task if self.env is None else f"{self.rl.env} ({self.rl.task_families})"
        ax.set_title(f"{what}: {self.rl.prompts_per_step} x {self.rl.group_size} per step", fontsize=9)
        ax.legend()
        fig.tight_layout()
        os.makedirs(self.cfg.checkpoint.save, exist_ok=True)
        path = os.path.join(self.cfg.checkpoint.save, "reward_curve.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
