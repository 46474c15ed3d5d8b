"""Training logs: Megatron-format stdout lines, TensorBoard, and wandb (offline by default)."""
from __future__ import annotations

import numbers
import os
import time
from typing import Optional


def megatron_line(iteration: int, train_iters: int, metrics: dict) -> str:
    """One log line in Megatron-LM's `training_log` format."""
    parts = [f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d}"]
    for key, value in metrics.items():
        if isinstance(value, float):
            text = f"{value:.6E}" if key.endswith("loss") or key == "learning rate" else f"{value:.3f}"
        else:
            text = str(value)
        parts.append(f"{key}: {text}")
    return " | ".join(parts) + " |"


def _is_scalar(value) -> bool:
    if isinstance(value, numbers.Number):
        return True
    return hasattr(value, "numel") and value.numel() == 1  # a one-element tensor or array


class TrainingLogger:
    """Writes metrics to stdout (rank 0), TensorBoard and wandb when configured."""

    def __init__(self, rank: int, tensorboard_dir: Optional[str] = None, wandb_project: Optional[str] = None,
                 wandb_name: Optional[str] = None, wandb_dir: Optional[str] = None, config: Optional[dict] = None):
        self.rank = rank
        self.tb = None
        self.wandb = None
        if rank != 0:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            os.environ.setdefault("WANDB_MODE", "offline")  # no account or network needed
            try:
                import wandb
            except ImportError:
                raise ValueError(f"--wandb-project {wandb_project} needs wandb, which is not installed: "
                                 "pip install wandb (or pip install -e '.[wandb]'), or drop --wandb-project") from None

            self.wandb = wandb.init(project=wandb_project, name=wandb_name, dir=wandb_dir,
                                    config=config or {}, reinit=True)

    def print(self, *args) -> None:
        if self.rank == 0:
            print(*args, flush=True)

    def log(self, iteration: int, train_iters: int, line_metrics: dict, scalars: dict) -> None:
        if self.rank != 0:
            return
        print(megatron_line(iteration, train_iters, line_metrics), flush=True)
        self.scalars(iteration, scalars)

    def scalars(self, iteration: int, scalars: dict) -> None:
        """The numbers of `scalars` to TensorBoard and wandb; text values (e.g. an evaluation's
        "stops": "finish 3, max_turns 1") are for the printed lines only."""
        if self.rank != 0:
            return
        numbers = {k: v for k, v in scalars.items() if _is_scalar(v)}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, iteration)
        if self.wandb is not None:
            self.wandb.log(numbers, step=iteration)

    def log_iteration(self, trainer, window: list) -> None:
        """The Megatron line (and TensorBoard / wandb scalars) for the steps in
        `window` (`StepResult`s since the last line; times and tokens are summed)."""
        if self.rank != 0 or not window:
            return
        st, last = trainer.state, window[-1]
        seconds = sum(r.seconds for r in window)
        tok_s = sum(r.tokens for r in window) / seconds
        world = trainer.layout.world_size
        line = {
            "consumed samples": st.consumed_samples,
            "consumed tokens": st.consumed_samples * trainer.cfg.seq_length,
            "elapsed time per iteration (ms)": 1000.0 * seconds / len(window),
            "learning rate": last.lr,
            "global batch size": trainer.global_batch_size,
            **last.losses,
            "grad norm": last.grad_norm,
            "number of skipped iterations": st.skipped_iterations,
            "tokens/s": tok_s,
            "throughput per rank (TFLOP/s)": tok_s * trainer.flops_per_token / world / 1e12,
        }
        scalars = {name.replace(" ", "-"): value for name, value in last.losses.items()}
        scalars.update({"learning-rate": last.lr, "grad-norm": last.grad_norm, "tokens-per-sec": tok_s,
                        "skipped-iterations": st.skipped_iterations})
        self.log(st.iteration, trainer.cfg.train_iters, line, scalars)

    def validation(self, iteration, loss: float) -> None:
        """Megatron's validation line; `iteration` None for the end of training."""
        where = "at the end of training" if iteration is None else f"at iteration {iteration}"
        self.print(f" validation loss {where} | lm loss value: {loss:.6E} |")
        if iteration is not None:
            self.scalars(iteration, {"validation-lm-loss": loss})

    def base_eval(self, iteration: int, scalars: dict) -> None:
        """One line of the base evals' figures, and the same scalars to TensorBoard / wandb."""
        figures = " | ".join(f"{name.split('/', 1)[-1]}: {value:.6E}" for name, value in scalars.items())
        self.print(f" base evals at iteration {iteration} | {figures} |")
        self.scalars(iteration, scalars)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
