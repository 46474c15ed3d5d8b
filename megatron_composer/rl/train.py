"""`train_rl.py`'s body and the synchronous driver.

    train_rl(argv)       parse once; the synchronous loop below, or with --async-rl the Ray services

The synchronous loop samples with the engine colocated on every rank, so it
takes data and context parallelism only; tensor or expert parallelism is
refused with `--async-rl` named (`trainer.colocated_engine_refusal`). With
`--rollout-backend vllm` it samples from a vLLM server instead, which gets the
policy gathered whole after every step (expert parallelism and HSDP allowed,
tensor and pipeline parallelism refused: `async_rl.gather.check_publishable`).

The synchronous driver only schedules; the step is `RLTrainer.train_on`, the
rollouts `RLTrainer.rollouts` over the environment interface, the report
`report.StepReport`. One step reads as one call chain:

    train_sync -> RLTrainer.rollouts -> Environment.run_group -> RolloutBackend.generate
               -> RLTrainer.train_on -> RLTrainer.prepare (score, pack, KL, advantages)
               -> Trainer.update -> Trainer.forward_backward -> PolicyLoss.loss_sum -> loss.backward()
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .arguments import parse_rl_args
from .build import build_rl_trainer
from .report import StepReport
from .rollout import due
from .trainer import RLTrainer, colocated_engine_refusal

LOG_KEYS = ("reward", "task all_pass", "zero-signal groups", "tasks in bounds", "policy loss", "grad norm", "completion length", "turns", "summaries",
            "feedback hints", "feedback kl", "logp mismatch mean", "step seconds")


def train_rl(argv: Optional[list[str]] = None):
    """Synchronous RL in this process (torchrun for more ranks), or with --async-rl the Ray services."""
    run = parse_rl_args(argv)
    if run.async_rl.enabled:
        from ..training.checkpointer import check_paths, moved_message
        from .async_rl.runner import run_async_rl

        ckpt = run.training.checkpoint
        moved = check_paths(ckpt.load, ckpt.save, ckpt.overwrite_save)  # before Ray starts
        if moved:
            print(moved_message(ckpt.save, moved), flush=True)

        return run_async_rl(run)
    if run.rl.rollout.backend == "engine":
        refusal = colocated_engine_refusal(run.parallel.tensor_model_parallel_size,
                                           run.parallel.expert_model_parallel_size,
                                           run.training.data_parallel_sharding)
        if refusal is not None:  # before any rank starts building
            raise ValueError(refusal)
    else:  # the policy is gathered whole for each push
        from .async_rl.gather import check_publishable

        p = run.parallel
        check_publishable(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_tensor_parallel_size)
    trainer = build_rl_trainer(run)
    try:
        trainer.resume()
        train_sync(trainer)
    finally:
        trainer.close()
        trainer.log.close()
    return trainer


def train_sync(trainer: RLTrainer) -> StepReport:
    """Sample, train, report until --train-iters: evaluate before the first step, every --eval-interval and
    at the end; log every --log-interval; save every --save-interval and at the end."""
    import time

    cfg, rl, st = trainer.cfg, trainer.rl, trainer.state
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    report = StepReport(cfg.checkpoint.save if rank0 else None,
                        f"{trainer.env.describe()}: {rl.rollout.prompts_per_step} x {rl.rollout.group_size} per step")
    trainer.report = report
    if cfg.checkpoint.save:
        trainer.checkpoints.prepare_save_dir()
    if st.iteration < cfg.train_iters:
        _evaluate(trainer, report)  # where RL starts
    while st.iteration < cfg.train_iters:
        started = time.perf_counter()
        samples = trainer.rollouts(st.iteration)
        rollout_seconds = time.perf_counter() - started
        metrics = trainer.train_on(samples)
        metrics.update(trainer.selection_metrics)  # --task-selection solve-rate
        metrics.update({"rollout seconds": rollout_seconds, "step seconds": time.perf_counter() - started})
        report.step(dict(metrics, iteration=st.iteration))
        if due(st.iteration, rl.rollout.eval_interval, -1) and st.iteration < cfg.train_iters:
            _evaluate(trainer, report)
        if due(st.iteration, cfg.log_interval, cfg.train_iters):
            trainer.log.log(st.iteration, cfg.train_iters, {k: metrics[k] for k in LOG_KEYS if k in metrics},
                            {f"rl/{k}": v for k, v in metrics.items()})
            report.plot()
        if cfg.checkpoint.save and due(st.iteration, cfg.checkpoint.save_interval, cfg.train_iters):
            trainer.checkpoints.save()
    _evaluate(trainer, report)
    report.plot()
    return report


def _evaluate(trainer: RLTrainer, report: StepReport) -> None:
    result = trainer.evaluate()
    if result is None:
        return
    report.evaluation(dict(result, iteration=trainer.state.iteration))
    more = "".join(f", {k[5:]} {result[k]:.3f}" for k in ("eval pass@k", "eval turns") if k in result)
    trainer.log.print(f"> eval at step {trainer.state.iteration}: solved {result['eval solved']:.3f} of "
                      f"{int(result['eval tasks'])} held-out tasks, correctness {result['eval correctness']:.3f}{more}")
