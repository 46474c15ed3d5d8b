"""`python -m megatron_composer.platform.doctor`: versions, GPU generations, recipes."""
import json
import os
import re
import subprocess
import sys

import megatron.core
import pytest
import torch

from megatron_composer.platform.doctor import c_compiler, format_report, judge
from megatron_composer.platform.recipes import generation as gpu_generation
from megatron_composer.platform.versions import (
    megatron_core_verdict,
    torch_verdict,
    transformer_engine_verdict,
)


@pytest.mark.parametrize("capability, name", [
    ((8, 0), "Ampere"), ((8, 9), "Ada"), ((9, 0), "Hopper"), ((10, 0), "Blackwell"),
    ((10, 3), "Blackwell Ultra"),
])
def test_gpu_generation(capability, name):
    assert gpu_generation(capability) == name


def test_gpu_generation_unknown_names_the_capability():
    assert "sm_991" in gpu_generation((99, 1))


# ---------------------------------------------------------------- version gates
@pytest.mark.parametrize("version, on_cuda, ok, note", [
    ("0.16.1", False, True, None),
    ("0.16.1", True, True, None),
    ("0.17.0", True, True, r"megatron-core 0\.17\.0 is accepted on CUDA but untested.*checked against 0\.16\.1"),
    ("0.19.2", True, True, r"0\.19\.2 is accepted on CUDA"),
    ("0.17.0", False, False, r"CPU backend patches megatron-core internals checked against 0\.16\.1 only.*"
                             r"pip install megatron-core==0\.16\.1"),
    ("0.19.2", False, False, r"on CPU pip install megatron-core==0\.16\.1"),
    ("0.20.0", True, False, r"megatron-core 0\.20\.0 is outside .*<0\.20 on CUDA"),
    ("0.15.3", True, False, r"megatron-core 0\.15\.3 is outside"),
    ("0.16.0", True, False, r"0\.16\.0 is outside"),
    ("dev", True, False, r"megatron-core dev is outside"),
    (None, True, False, r"megatron-core does not import"),
])
def test_megatron_core_gate(version, on_cuda, ok, note):
    verdict = megatron_core_verdict(version, on_cuda)
    assert verdict.ok is ok
    if note is None:
        assert verdict.note is None
    else:
        assert verdict.note is not None and re.search(note, verdict.note), verdict.note


@pytest.mark.parametrize("version, ok, noted", [
    (None, True, False), ("2.9.0", True, False), ("2.11.0+cu13", True, False), ("2.9.0.dev0", True, False),
    ("2.12.0", True, True), ("2.14.0+5a0c1a8", True, True), ("3.0.0", True, True),
    ("2.8.1", False, True), ("dev", False, True),
])
def test_transformer_engine_gate(version, ok, noted):
    verdict = transformer_engine_verdict(version)
    assert verdict.ok is ok and (verdict.note is not None) is noted
    if version == "2.12.0":
        assert "newer than megatron-core 0.16.1 declares (>=2.9,<2.12); accepted" in verdict.note


@pytest.mark.parametrize("version, on_cuda, ok, note", [
    ("2.13.0+cpu", False, True, None),
    ("2.10.0+cu129", True, True, None),
    ("2.9.1+cu128", True, True, r"no torch\.nn\.attention\.varlen \(torch>=2\.10\)"),
    ("2.9.1", False, True, None),  # CPU runs packed documents per document anyway
    ("2.8.0+cu128", True, False, r"torch 2\.8\.0\+cu128 is older than 2\.9: torch\._grouped_mm"),
    ("2.6.0", False, False, r"install torch>=2\.9"),
])
def test_torch_gate(version, on_cuda, ok, note):
    verdict = torch_verdict(version, on_cuda)
    assert verdict.ok is ok
    assert (verdict.note is None) if note is None else re.search(note, verdict.note)


# ---------------------------------------------------------------- C compiler, broken TE
def _executable(path):
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_c_compiler_follows_tritons_order(tmp_path):
    gcc, clang = _executable(tmp_path / "gcc"), _executable(tmp_path / "clang")
    assert c_compiler({"PATH": str(tmp_path)}) == {"compiler": gcc, "source": "PATH", "problem": None}
    assert c_compiler({"PATH": str(tmp_path), "CC": "clang"})["compiler"] == clang
    missing = c_compiler({"PATH": str(tmp_path), "CC": "icx -O2"})
    assert missing["problem"] == "CC='icx -O2' is not an executable on PATH"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert c_compiler({"PATH": str(empty)})["problem"] == "no C compiler (CC unset, no gcc or clang on PATH)"


def _facts(**changes):
    info = {"python": "3.12.3", "torch": "2.10.0+cu130", "torch_cuda": "13.0", "cudnn": 91300, "nccl": "2.28.3",
            "torch_grouped_mm": True, "torch_varlen_attn": True, "cuda_available": True,
            "megatron_core": "0.16.1", "megatron_core_import_error": None,
            "transformer_engine": "2.11.0", "transformer_engine_import_error": None,
            "flash_attn": None, "triton": "3.5.0", "gpus": [], "problems": [], "warnings": [],
            "c_compiler": {"compiler": "/usr/bin/gcc", "source": "PATH", "problem": None}}
    info.update(changes)
    return info


def test_no_compiler_is_a_problem_on_cuda_and_a_warning_on_cpu():
    none = {"compiler": None, "source": None, "problem": "no C compiler (CC unset, no gcc or clang on PATH)"}
    gpu = _facts(c_compiler=none)
    judge(gpu)
    assert len(gpu["problems"]) == 1 and "Triton builds its launcher with a host C compiler" in gpu["problems"][0]
    cpu = _facts(c_compiler=none, cuda_available=False, torch_cuda=None, transformer_engine=None)
    judge(cpu)
    assert cpu["problems"] == [] and "set CC" in cpu["warnings"][0]


def test_a_gpu_report_names_what_blocks_a_recipe():
    info = _facts(torch="2.9.1+cu128", torch_cuda="12.8", megatron_core="0.18.0", transformer_engine="2.13.0",
                  gpus=[{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "generation": "Hopper",
                         "memory_gib": 79.2, "bf16": True, "te_recipes": ["fp8-tensorwise"],
                         "te_recipes_with_te_installed": ["fp8-tensorwise"],
                         "te_recipes_blocked": {"fp8-blockwise": "CUDA 12.9 or newer"},
                         "moe_expert_precision": ["bf16", "mxfp8", "nvfp4"], "triton_quantizers": True}])
    judge(info)
    assert info["problems"] == []
    assert [w.split(" is ")[0] for w in info["warnings"]] == ["torch 2.9.1+cu128 has no torch.nn.attention.varlen "
                                                              "(torch>=2.10): packed documents run one SDPA call "
                                                              "per document", "megatron-core 0.18.0",
                                                              "transformer-engine 2.13.0"]
    text = format_report(info)
    assert "  TE recipes        fp8-tensorwise\n  not fp8-blockwise  needs CUDA 12.9 or newer\n" in text
    assert "C compiler          /usr/bin/gcc" in text and text.endswith("status              ok")


def test_doctor_names_a_transformer_engine_that_fails_to_load(tmp_path):
    """A TE whose shared library does not load raises OSError, not ImportError."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise OSError("libtransformer_engine.so: cannot open shared object file: No such file or directory")\n')
    dist = tmp_path / "transformer_engine-2.10.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.10.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = _doctor("--json", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    info = json.loads(proc.stdout)
    assert info["transformer_engine"] == "2.10.0"
    assert info["transformer_engine_import_error"].startswith("OSError: libtransformer_engine.so: cannot open")
    assert any("transformer-engine 2.10.0 is installed but does not import (OSError: libtransformer_engine.so"
               in p and "catches only ImportError" in p for p in info["problems"]), info["problems"]
    # and megatron-core, which imports TE behind `except ImportError`, goes down with it
    assert info["megatron_core_import_error"].startswith("OSError: libtransformer_engine.so")


def _doctor(*args, env=None):
    return subprocess.run([sys.executable, "-m", "megatron_composer.platform.doctor", *args],
                          capture_output=True, text=True, timeout=120, env=env)


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
