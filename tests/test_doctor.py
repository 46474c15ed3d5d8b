"""`python -m megatron_composer.platform.doctor`: versions, GPU generations, recipes."""
import json
import subprocess
import sys

import megatron.core
import pytest
import torch

from megatron_composer.platform.doctor import _te_in_range
from megatron_composer.platform.recipes import generation as gpu_generation


@pytest.mark.parametrize("capability, name", [
    ((8, 0), "Ampere"), ((8, 9), "Ada"), ((9, 0), "Hopper"), ((10, 0), "Blackwell"),
    ((10, 3), "Blackwell Ultra"),
])
def test_gpu_generation(capability, name):
    assert gpu_generation(capability) == name


def test_gpu_generation_unknown_names_the_capability():
    assert "sm_991" in gpu_generation((99, 1))


@pytest.mark.parametrize("version, ok", [("2.9.0", True), ("2.11.0+cu13", True), ("2.12.0", False),
                                         ("2.8.1", False), ("dev", False)])
def test_transformer_engine_range(version, ok):
    assert _te_in_range(version) is ok


def _doctor(*args):
    return subprocess.run([sys.executable, "-m", "megatron_composer.platform.doctor", *args],
                          capture_output=True, text=True, timeout=120)


def test_doctor_json_reports_this_machine():
    proc = _doctor("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout)
    assert info["torch"] == torch.__version__
    assert info["megatron_core"] == megatron.core.__version__ == "0.16.1"
    assert info["cuda_available"] == torch.cuda.is_available()
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert info["problems"] == []


def test_doctor_text(capsys):
    from megatron_composer.platform.doctor import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert f"torch               {torch.__version__}" in out
    assert "megatron-core       0.16.1" in out
    assert out.rstrip().endswith("status              ok")
