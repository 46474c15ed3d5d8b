"""The GPU check's CPU-checkable parts.

* `pytest -m gpu` collects on a machine that has only torch and the wheels `tools/gpu_check.sh`
  installs, simulated by a `sitecustomize` that hides every top-level module in site-packages
  except those of torch's requirements and of tools/gpu_wheels.txt; the modules left out are
  reported, and a module with GPU tests that cannot import stays an error.
* test_gpu_training's host-side choices: the CPU reference process keeps the inherited
  PYTHONPATH, and the fp32 parity keeps megatron-core's router GEMM off Transformer Engine
  (whose GEMM computes fp32 with TF32).
* benchmarks/gpu_step.py: the peak table, MFU, the result line, the runs and their layers, the
  run-by-run printing that goes on after a failure, megatron-core accepting the TE baseline.
* tools/gpu_check.sh with a stand-in interpreter: the one closing summary line and the budget.
"""
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]

HIDE_SITE_PACKAGES = '''
import os, site, sys

KEEP = set(os.environ["KEEP_MODULES"].split(","))
SITE = {os.path.realpath(p) for p in site.getsitepackages()}


class Hidden:
    """Find top-level site-packages modules in KEEP only, as if nothing else were installed."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        spec = self.finder.find_spec(name, path, target)
        if spec is None or "." in name or name in KEEP or not spec.origin:
            return spec
        where = os.path.dirname(os.path.realpath(spec.origin))
        if spec.submodule_search_locations:
            where = os.path.dirname(where)
        return None if where in SITE else spec

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Hidden(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


def gpu_check_distributions() -> set[str]:
    """The distributions `tools/gpu_check.sh` installs: tools/gpu_wheels.txt's second column."""
    lines = (REPO / "tools" / "gpu_wheels.txt").read_text().splitlines()
    return {Requirement(line.split()[1]).name.lower() for line in lines if line.strip() and not line.startswith("#")}


def requirement_closure(roots) -> set[str]:
    """`roots` and everything they require (markers evaluated for this machine, no extras)."""
    seen, todo = set(), [r.lower() for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for spec in map(Requirement, requires):
            if spec.marker is None or spec.marker.evaluate({"extra": ""}):
                todo.append(spec.name.lower())
    return seen


def fresh_gpu_machine_modules() -> set[str]:
    """Top-level modules of torch (CUDA builds also bring triton), pip, and gpu_check.sh's wheels."""
    keep = requirement_closure({"torch", "triton", "pip"} | gpu_check_distributions())
    normalized = {k.replace("_", "-") for k in keep}
    return {module for module, dists in importlib.metadata.packages_distributions().items()
            if any(d.lower().replace("_", "-") in normalized for d in dists)}


def test_gpu_check_installs_what_the_code_needs():
    dists = gpu_check_distributions()
    assert {"megatron-core", "pytest", "numpy", "sentencepiece"} <= dists, dists
    assert "hypothesis" not in dists  # optional: its test modules are reported as not collected


def test_gpu_suite_collects_with_only_torch_and_the_carried_wheels(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_SITE_PACKAGES)
    keep = fresh_gpu_machine_modules()
    assert {"torch", "megatron", "pytest", "numpy"} <= keep and not {"hypothesis", "httpx", "ray"} & keep
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
               KEEP_MODULES=",".join(sorted(keep)), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-rs",
                          "-p", "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for node in ("tests/test_gpu_training.py::test_cuda_fp32_equals_cpu_fp32_and_cpu_checkpoints_load",
                 "tests/test_gpu_attention.py::test_packed_32k_four_documents_fits",
                 "tests/test_quant_kernels.py::test_cuda_dequantize_kernels_equal_reference"):
        assert node in out, out[-4000:]
    # each module left out is named, with the module it lacks, in the summary
    skipped = dict(re.findall(r"SKIPPED \[\d+\] (tests/\w+\.py)\S*: .*?needs (\w+)", out))
    assert skipped.get("tests/test_server.py") == "httpx", out[-4000:]
    assert skipped.get("tests/test_rl_packing.py") == "hypothesis", out[-4000:]


HALF_INSTALLED = {
    "conftest.py": "from tests.conftest import pytest_make_collect_report  # noqa: F401\n",
    "test_optional.py": "import not_installed_anywhere_pkg\n\ndef test_cpu():\n    pass\n",
    "test_gpu_needs_it.py": ("import pytest\nimport not_installed_anywhere_pkg\n\n"
                             "@pytest.mark.gpu\ndef test_gpu():\n    pass\n"),
}


def test_a_missing_optional_module_is_reported_and_a_gpu_module_still_fails(tmp_path):
    for name, text in HALF_INSTALLED.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def pytest_run(*args):
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        return run.returncode, run.stdout + run.stderr

    code, out = pytest_run("-m", "gpu")
    assert code != 0, out  # the module with a GPU test is an error, not a skip
    assert "ERROR collecting test_gpu_needs_it.py" in out and "not_installed_anywhere_pkg" in out, out
    assert re.search(r"SKIPPED \[1\] test_optional.py: not collected: it needs not_installed_anywhere_pkg", out), out
    code, out = pytest_run("-m", "not gpu", "test_optional.py")
    assert code != 0 and "ERROR collecting test_optional.py" in out, out  # the CPU suite keeps the import error


def test_cpu_reference_process_keeps_the_inherited_pythonpath():
    from tests.test_gpu_training import reference_env

    site = "/tmp/mc-site.abc123"  # where tools/gpu_check.sh installs the wheels
    env = reference_env({"PYTHONPATH": f"{site}:/work/repo", "RANK": "3", "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), site, "/work/repo"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "RANK" not in env and env["HOME"] == "/root"
    assert reference_env({})["PYTHONPATH"] == str(REPO)


def test_parity_gemms_skip_transformer_engine_and_tf32(monkeypatch):
    """Where TE imports, megatron-core's router GEMM calls TE (TF32 for fp32 inputs); inside
    `fp32_gemms` it is torch.mm in fp32, and both switches come back afterwards."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    from tests.test_gpu_training import fp32_gemms

    calls = []

    def te_gemm(weight, inp, dtype, **kwargs):  # what TE returns: a tuple, the output first
        calls.append(kwargs["layout"])
        return (torch.zeros(inp.shape[0], weight.shape[0], dtype=dtype),)

    monkeypatch.setattr(moe_utils, "te_general_gemm", te_gemm, raising=False)
    x, w = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)), torch.randn(4, 8)
    moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert calls == ["TN"]  # the fake stands in for TE here
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with fp32_gemms():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert calls == ["TN"] and torch.equal(logits, x @ w.t())
    assert moe_utils.te_general_gemm is te_gemm


def gpu_step_module():
    """benchmarks/gpu_step.py, imported (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_step", REPO / "benchmarks" / "gpu_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_step"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_ours_is_built_with_the_transformer_impl_asked_for(monkeypatch):
    import megatron_composer.training as training
    from megatron_composer.config import get_preset

    built = []

    class Recorded:
        def __init__(self, model_cfg, layout, data, cfg, **kwargs):
            built.append(cfg)

    monkeypatch.setattr(training, "Trainer", Recorded)
    gpu_step = gpu_step_module()
    for impl in ("transformer_engine", "local"):
        gpu_step.ours_step_fn(get_preset("tiny"), 256, 2, [], impl)
    assert [c.transformer.transformer_impl for c in built] == ["transformer_engine", "local"]
    assert all(c.bf16 and c.seq_length == 256 and c.micro_batch_size == 2 for c in built)


def test_peak_bf16_tflops_by_device_name():
    peak = gpu_step_module().peak_bf16_tflops
    # dense bf16 datasheet figures: H100/H200 SXM 989, B200 2250, GB200 2500 TFLOP/s
    assert peak("NVIDIA H200") == 989 and peak("NVIDIA H100 80GB HBM3") == 989
    assert peak("NVIDIA B200") == 2250 and peak("NVIDIA GB200") == 2500
    assert peak("NVIDIA H100 PCIe") is None and peak("NVIDIA H100 NVL") is None  # lower clocks
    assert peak("NVIDIA GeForce RTX 4090") is None and peak("NVIDIA A100-SXM4-80GB") is None


def test_mfu_and_the_result_line():
    gpu_step = gpu_step_module()
    # 4096 tokens in 0.5 s = 8192 tokens/s; x 6e9 FLOP = 4.9152e13 FLOP/s; / 989e12 = 0.049699
    assert gpu_step.mfu(8192, 6e9, 989) == pytest.approx(0.0496987, rel=1e-5)
    result = gpu_step.Result("ours local", 0.5, 4096, 41.25, 10.4, 10.1)
    assert result.line(6e9, 989) == ("gpu_step: ours local: 8192 tokens/s, 500.0 ms/step, MFU 5.0%, "
                                     "peak memory 41.25 GiB, lm loss 10.400 -> 10.100")
    on_cpu = gpu_step.Result("ours local", 2.0, 64, None, 8.3, 8.2)
    assert on_cpu.line(1e7, None) == ("gpu_step: ours local: 32 tokens/s, 2000.0 ms/step, MFU n/a, "
                                      "peak memory n/a, lm loss 8.300 -> 8.200")


def test_each_run_prints_when_done_and_a_failure_does_not_stop_the_others():
    gpu_step = gpu_step_module()
    events = []

    def failing():
        events.append("build baseline")
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(details)")

    def working():
        events.append("build ours")
        return "step"

    def measure(name, build):
        assert build() == "step"
        return gpu_step.Result(name, 0.25, 1000, 1.5, 9.0, 8.0)

    results = gpu_step.run_all([("megatron-core GPTModel local", failing), ("ours local", working)],
                               measure, events.append, 4e9, 1000.0)
    assert events == [
        "build baseline",
        "gpu_step: megatron-core GPTModel local: FAILED RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "build ours",
        "gpu_step: ours local: 4000 tokens/s, 250.0 ms/step, MFU 1.6%, peak memory 1.50 GiB, lm loss 9.000 -> 8.000",
    ]
    assert [r.name for r in results] == ["ours local"]


def test_runs_ours_local_and_te_against_megatron_core_and_the_ratio(monkeypatch):
    import megatron_composer.training as training
    from megatron_composer.config import get_preset

    gpu_step = gpu_step_module()
    cfg = get_preset("tiny")
    names = [name for name, _ in gpu_step.plan_runs(cfg, 64, 1, [], None, te=False, baseline=True)]
    assert names == ["ours local", "megatron-core GPTModel local"]
    runs = gpu_step.plan_runs(cfg, 64, 1, [], None, te=True, baseline=True)
    assert [name for name, _ in runs] == ["ours local", "ours transformer_engine",
                                          "megatron-core GPTModel transformer_engine"]
    built = []
    monkeypatch.setattr(training, "Trainer", lambda model_cfg, layout, data, cfg: built.append(cfg))
    for _, build in runs[:2]:
        build()
    assert [c.transformer.transformer_impl for c in built] == ["local", "transformer_engine"]

    Result = gpu_step.Result
    results = [Result("ours local", 0.5, 4096, 40.0, 9, 8), Result("ours transformer_engine", 0.4, 4096, 30.0, 9, 8),
               Result("megatron-core GPTModel transformer_engine", 0.5, 4096, 25.0, 9, 8)]
    assert gpu_step.ratio_line(results) == ("gpu_step: ratio ours transformer_engine / megatron-core GPTModel "
                                            "transformer_engine: tokens/s 1.250 (target >= 0.9), peak memory 1.200")
    assert gpu_step.ratio_line(results[:2]) is None


def test_te_baseline_config_is_one_megatron_core_accepts(monkeypatch):
    """MLA with plain RoPE and TE's grouped experts / fused permute; TE itself is faked (the
    config only checks that its functions exist)."""
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe import moe_utils

    from megatron_composer.config import get_preset

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)
    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *a, **k: True, raising=False)
    tconfig, position = gpu_step_module().baseline_config(get_preset("small"), te=True, cuda=True)
    assert type(tconfig).__name__ == "MLATransformerConfig" and position == "none"
    assert tconfig.moe_grouped_gemm and tconfig.moe_permute_fusion and tconfig.rope_type == "rope"
    local, position = gpu_step_module().baseline_config(get_preset("small"), te=False, cuda=True)
    assert type(local).__name__ == "TransformerConfig" and position == "rope"


@pytest.mark.slow
def test_cpu_check_run_prints_each_run():
    run = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--device", "cpu", "--preset", "tiny",
                          "--seq-length", "64", "--steps", "1", "--warmup", "1"],
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("gpu_step: ")]
    assert [line.split(":")[1].strip() for line in lines] == [
        "ours local", "megatron-core GPTModel local", "ratio ours local / megatron-core GPTModel local"], run.stdout
    assert all("FAILED" not in line and "MFU n/a" in line for line in lines[:2]), lines


FAKE_PYTHON = r'''#!/usr/bin/env bash
# stands in for the GPU machine's python: canned outputs, FAKE_RUN=ok|failing
case "$*" in
    "-c import "*) exit 0 ;;
    "-c "*) echo "NVIDIA H200 torch 2.11.0 CUDA 12.9" ;;
    "-m megatron_composer.platform.doctor") echo "status              ok" ;;
    "-m pytest -m gpu "*)
        echo "SKIPPED [1] tests/test_server.py: not collected: it needs httpx, which is not installed"
        if [ "$FAKE_RUN" = ok ]; then echo "41 passed, 11 skipped, 856 deselected in 98.76s (0:01:38)"; exit 0; fi
        echo "2 failed, 39 passed, 11 skipped, 856 deselected, 1 error in 101.20s (0:01:41)"; exit 1 ;;
    "-m pytest -q -s -p no:cacheprovider tests/test_host_syncs.py")
        echo "..host syncs per step: 3 (grad norm 1, finite flag 1, loss values 1)"; echo "9 passed in 20.1s" ;;
    "benchmarks/gpu_step.py --steps 8")
        echo "GPU NVIDIA H200, dense bf16 peak 989 TFLOP/s"
        echo "gpu_step: ours local: 21000 tokens/s, 195.0 ms/step, MFU 13.8%, peak memory 30.10 GiB, lm loss 10.4 -> 10.1"
        if [ "$FAKE_RUN" = ok ]; then
            echo "gpu_step: megatron-core GPTModel local: 20000 tokens/s, 204.8 ms/step, MFU 13.2%, peak memory 35.00 GiB, lm loss 10.4 -> 10.2"
        else
            echo "gpu_step: megatron-core GPTModel local: FAILED NameError: name 'te_general_gemm' is not defined"; exit 1
        fi ;;
    "benchmarks/quant.py --device cuda") echo "quantizers ok" ;;
    *) echo "fake python: unexpected arguments: $*"; exit 2 ;;
esac
'''


def run_gpu_check(tmp_path, fake_run, **env_vars):
    """tools/gpu_check.sh in a copy of the repository's layout, with the fake python."""
    root = tmp_path / fake_run
    (root / "tools").mkdir(parents=True)
    (root / "tests").mkdir()
    for name in ("gpu_check.sh", "gpu_wheels.txt"):
        (root / "tools" / name).write_text((REPO / "tools" / name).read_text())
    (root / "tests" / "test_host_syncs.py").write_text("")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), OUT=str(root / "out"), FAKE_RUN=fake_run,
               PATH="/usr/bin:/bin", **env_vars)  # no nvidia-smi
    run = subprocess.run(["bash", str(root / "tools" / "gpu_check.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    return run.returncode, run.stdout.strip().splitlines()


def test_gpu_check_ends_with_one_summary_line(tmp_path):
    code, lines = run_gpu_check(tmp_path, "ok")
    assert code == 0, lines
    assert re.fullmatch(
        r"gpu check ok in \d+ s \| tests: 41 passed, 0 failed, 11 skipped \| "
        r"host syncs per step: 3 \(grad norm 1, finite flag 1, loss values 1\) \| "
        r"ours local: 21000 tokens/s, 195\.0 ms/step, MFU 13\.8%, peak memory 30\.10 GiB, lm loss 10\.4 -> 10\.1; "
        r"megatron-core GPTModel local: 20000 tokens/s, 204\.8 ms/step, MFU 13\.2%, peak memory 35\.00 GiB, "
        r"lm loss 10\.4 -> 10\.2", lines[-1]), lines[-1]
    assert "  tests/test_server.py: not collected" not in lines  # listed as pytest printed it:
    assert "  SKIPPED [1] tests/test_server.py: not collected: it needs httpx, which is not installed" in lines


def test_gpu_check_summary_names_the_failed_steps_and_keeps_every_result(tmp_path):
    code, lines = run_gpu_check(tmp_path, "failing")
    assert code == 1, lines
    assert re.fullmatch(
        r"gpu check FAILED \(pytest-gpu, bench-gpu-step\) in \d+ s \| tests: 39 passed, 2 failed, 11 skipped, "
        r"1 error \| host syncs per step: 3 \(grad norm 1, finite flag 1, loss values 1\) \| "
        r"ours local: 21000 tokens/s, .*; megatron-core GPTModel local: FAILED NameError: "
        r"name 'te_general_gemm' is not defined", lines[-1]), lines[-1]
    assert "  bench-quant: ok" in lines  # the steps after a failure still ran


def test_gpu_check_runs_no_step_past_its_budget(tmp_path):
    code, lines = run_gpu_check(tmp_path, "ok", GPU_CHECK_BUDGET_S="5")
    assert code == 1 and "  install: not run (budget spent)" in lines, lines
    assert re.fullmatch(r"gpu check FAILED \(install, no gpu test passed\) in \d+ s \| tests: no pytest result \| "
                        r"host syncs per step: not measured \| no benchmark result", lines[-1]), lines[-1]


def test_gpu_check_scripts_parse():
    for script in ("gpu_check.sh", "fetch_gpu_wheels.sh"):
        run = subprocess.run(["bash", "-n", str(REPO / "tools" / script)], capture_output=True, text=True)
        assert run.returncode == 0, (script, run.stderr)
