"""The GPU check end to end on CPU, in subprocesses (unit tests: tests/test_gpu_host_side.py).

* `pytest -m gpu` collects on a machine that has only torch and the wheels `tools/gpu_check.sh`
  installs, simulated by a `sitecustomize` that hides every top-level module in site-packages
  except those of torch's requirements and of tools/gpu_wheels.txt; the modules left out are
  reported, and a module with GPU tests that cannot import stays an error.
* benchmarks/gpu_step.py runs on CPU (`--device cpu`), printing a line per run.
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


def pytest_free_environ() -> dict:
    """This environment without what a pytest-xdist worker sets: a pytest started from here is its own run."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}


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


@pytest.mark.slow
def test_gpu_suite_collects_with_only_torch_and_the_carried_wheels(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_SITE_PACKAGES)
    keep = fresh_gpu_machine_modules()
    assert {"torch", "megatron", "pytest", "numpy"} <= keep and not {"hypothesis", "httpx", "ray"} & keep
    env = dict(pytest_free_environ(), PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
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
    env = dict(pytest_free_environ(), PYTHONPATH=str(REPO))

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
