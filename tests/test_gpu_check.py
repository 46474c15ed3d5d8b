"""The GPU check's CPU-checkable parts: `pytest -m gpu` collects on a machine that has only
torch and the wheels `tools/gpu_check.sh` installs, and the GPU tests' own host-side decisions.

The "fresh GPU machine" is simulated by a `sitecustomize` that hides every top-level module
installed in site-packages except those of torch's own requirements and of the distributions
`tools/gpu_check.sh` installs: exactly what that machine has.
"""
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
GPU_CHECK = REPO / "tools" / "gpu_check.sh"

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
    """The distributions `tools/gpu_check.sh` installs (its `module:distribution` pairs)."""
    text = GPU_CHECK.read_text()
    pairs = re.findall(r"\b[\w.]+:([A-Za-z][\w.-]*?)(?:==[\w.]+)?(?=\s|\\|;)", text.split("install_missing()", 1)[1])
    return {Requirement(p).name.lower() for p in pairs}


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
