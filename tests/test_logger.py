"""TrainingLogger: optional wandb."""
import sys

import pytest

from megatron_composer.training.logger import TrainingLogger


def test_wandb_project_without_wandb_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb looks like
    with pytest.raises(ValueError, match=r"--wandb-project demo needs wandb.*pip install wandb"):
        TrainingLogger(0, wandb_project="demo")


def test_other_ranks_never_import_wandb(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert TrainingLogger(1, wandb_project="demo").wandb is None


def test_text_values_stay_out_of_tensorboard(tmp_path):
    """An evaluation row carries text ("stops": "max_turns 4"): TensorBoard gets the numbers only."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TrainingLogger(0, tensorboard_dir=str(tmp_path))
    log.scalars(3, {"eval solved": 0.25, "eval tasks": 4, "eval stops": "max_turns 4",
                    "loss": torch.tensor(1.5)})
    log.tb.flush()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval solved", "eval tasks", "loss"]
    assert [(e.step, e.value) for e in events.Scalars("eval tasks")] == [(3, 4.0)]
