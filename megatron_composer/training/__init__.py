"""The shared training loop: Trainer, loss plug-ins, checkpointing of a run, logging."""
from .trainer import StepResult, Trainer, TrainingAborted, TrainingData, TrainState

__all__ = ["StepResult", "TrainState", "Trainer", "TrainingAborted", "TrainingData"]
