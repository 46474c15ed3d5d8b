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
