"""The host-side decisions of the GPU tests and of the GPU benchmark, checked on CPU.

* test_gpu_training: the CPU reference process keeps the inherited PYTHONPATH (where
  tools/gpu_check.sh installs packages), and the fp32 parity keeps megatron-core's router GEMM off
  Transformer Engine (whose GEMM computes fp32 inputs with TF32).
* benchmarks/gpu_step.py: the peak table, MFU, the result line, the runs and their layers, the
  run-by-run printing that goes on after a failure, megatron-core accepting the TE baseline.
"""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
