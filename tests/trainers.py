"""Build a Trainer for tests in one line: the tiny preset, small shapes.

    tr = make_trainer(dataset, ep=2, optimizer="muon", micro_batch_size=1)

Keyword arguments are `TrainingConfig` fields, or `OptimizerConfig` fields
(`optimizer`, `lr`, ...), or the parallel sizes `tp`, `cp`, `ep`, `etp`; the world
size is torch.distributed's (a single process when not initialized).
"""
from __future__ import annotations


def make_trainer(dataset, *, model_cfg=None, tp=1, cp=1, ep=1, etp=1, valid=None, batch_transform=None, **fields):
    import dataclasses

    import torch.distributed as dist

    from megatron_composer.config import CheckpointConfig, OptimizerConfig, TrainingConfig, get_preset
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.platform import init_distributed
    from megatron_composer.training.trainer import Trainer, TrainingData

    init_distributed()
    model_cfg = model_cfg or get_preset("tiny")
    optimizer = {"lr": 3e-3, "lr_warmup_iters": 2, "lr_decay_iters": 8}
    optimizer_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    optimizer.update({k: fields.pop(k) for k in list(fields) if k in optimizer_fields})
    checkpoint = fields.pop("checkpoint", {})
    defaults = {"seq_length": 64, "micro_batch_size": 2, "global_batch_size": 4}
    cfg = TrainingConfig(**{**defaults, **fields}, optimizer=OptimizerConfig(**optimizer),
                         checkpoint=CheckpointConfig(**checkpoint))
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=tp, cp=cp, ep=ep, etp=etp,
                            num_experts=model_cfg.num_experts or None)
    return Trainer(model_cfg, layout, TrainingData(dataset, valid), cfg, batch_transform=batch_transform)


def cpt_losses(data_dir, *, steps=30, bf16=False, expert_precision="bf16") -> list[float]:
    """lm losses of `steps` tiny-preset CPT steps on the embedded data (sequence 64, seed 5, warm-up 3,
    decay over the run): the run `tiny_cpt_losses` in tests/conftest.py computes once per session.
    `expert_precision` "bf16" means unquantized experts, in the model's dtype."""
    from megatron_composer.config import MoEPrecisionConfig
    from megatron_composer.data import CPTDataset

    trainer = make_trainer(CPTDataset(str(data_dir / "stdlib_train"), 64, seed=5), lr_warmup_iters=3,
                           lr_decay_iters=steps, bf16=bf16,
                           moe_precision=MoEPrecisionConfig(moe_expert_precision=expert_precision))
    return [trainer.step().lm_loss for _ in range(steps)]


def pretrain_in_process(argv, capsys):
    """`python pretrain_cpt.py *argv` as its `main(argv)` in this process, for a check that stops before
    the first step (an interpreter start, about 10 s on 2 cores, costs more than the check): a
    `subprocess.CompletedProcess` with its exit code, stdout and stderr."""
    import subprocess

    import pretrain_cpt

    capsys.readouterr()
    code = pretrain_cpt.main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["pretrain_cpt.py", *argv], code, out.out, out.err)
