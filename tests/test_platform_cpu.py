"""Each CPU shim of platform.cpu does what its table row says (CPU only)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from megatron_composer.platform import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are not applied with CUDA")


@pytest.fixture(scope="module", autouse=True)
def shims():
    return cpu.apply_cpu_shims()


def test_every_table_row_is_applied(shims):
    assert shims == [s.name for s in cpu.SHIMS]
    for shim in cpu.SHIMS:
        assert f"| {shim.name} |" in cpu.__doc__, f"{shim.name} missing from the shim table"


def test_current_device_is_cpu():
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_cuda_rng_state_follows_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.manual_seed(3)
    assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # fork restored the default stream
    with tracker.fork():
        b = torch.rand(3)
    torch.manual_seed(7)
    expected = torch.rand(6)
    torch.testing.assert_close(torch.cat([a, b]), expected)  # one tracked stream, seeded 7


def test_streams_and_events_are_noops():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.ones(2) + 1
    s.wait_stream(torch.cuda.current_stream())
    ev = s.record_event()
    ev.synchronize()
    assert torch.equal(x, torch.full((2,), 2.0))


def test_synchronize_and_memory_stats():
    assert torch.cuda.synchronize() is None
    assert torch.cuda.max_memory_allocated() == 0 and torch.cuda.memory_allocated() == 0


def test_tensor_cuda_stays_on_cpu():
    t = torch.arange(4)
    assert t.cuda().device.type == "cpu"
    assert t.to("cuda").device.type == "cpu"
    assert t.to(device="cuda", dtype=torch.float32).dtype == torch.float32
    assert t.to(torch.float64).dtype == torch.float64  # non-device calls unchanged


def test_device_cuda_literal_factories():
    for make in (lambda: torch.zeros(2, device="cuda"), lambda: torch.empty(2, device="cuda:0"),
                 lambda: torch.tensor([1.0], device="cuda"), lambda: torch.arange(3, device="cuda"),
                 lambda: torch.ones(1, device=torch.device("cuda"))):
        assert make().device.type == "cpu"


def test_alltoall_splits_become_numpy():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    splits = torch.tensor([3, 1])
    out = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(out, np.ndarray) and out.tolist() == [3, 1]
    assert moe_utils.maybe_move_tensor_to_cpu(splits) is splits


def test_version_mismatch_is_refused(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.15.0")
    with pytest.raises(cpu.MegatronCoreVersionError, match=r"megatron-core 0\.15\.0.*megatron-core==0\.16\.1"):
        cpu.check_megatron_core_version()


def test_megatron_needs_the_shims_without_them():
    """Without the shims, building the MLA rotary embedding fails on CPU: the table is needed."""
    code = textwrap.dedent("""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        try:
            RotaryEmbedding(16, rotary_percent=1.0, use_cpu_initialization=False)
        except (AssertionError, RuntimeError) as e:
            print("FAILS:", type(e).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "FAILS" in out.stdout, out.stderr[-2000:]


def test_device_context_still_applies_to_factories():
    with torch.device("meta"):
        assert torch.arange(3).device.type == "meta"
        assert torch.zeros(2).device.type == "meta"


def test_torch_compile_runs_eagerly_on_cpu():
    import torch._dynamo

    assert torch._dynamo.config.disable is True
    calls = []

    @torch.compile
    def f(x):
        calls.append(1)  # a Python side effect: runs on every call only when eager
        return x * 2

    f(torch.ones(2)), f(torch.ones(2))
    assert len(calls) == 2


def test_router_gemm_takes_torch_mm_on_cpu_even_where_te_imports(monkeypatch):
    """A CPU run on a machine with Transformer Engine: megatron's router would hand TE's CUDA-only
    GEMM CPU tensors; the shim sends it to megatron's own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    def te_gemm(*args, **kwargs):
        raise RuntimeError("TE's GEMM takes CUDA tensors only")

    monkeypatch.setattr(moe_utils, "te_general_gemm", te_gemm, raising=False)
    inp, weight = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    cpu._shim_router_gemm_torch()
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    out.sum().backward()
    torch.testing.assert_close(out, inp @ weight.T, rtol=0, atol=0)
    torch.testing.assert_close(inp.grad, torch.ones(5, 4) @ weight, rtol=0, atol=0)
