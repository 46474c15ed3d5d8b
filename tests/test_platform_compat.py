"""platform.compat: megatron-core's defects without Transformer Engine are fixed on CUDA too."""
import importlib.util

import pytest
import torch
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.moe import moe_utils

from megatron_composer.platform import compat
from megatron_composer.platform import distributed as pd

no_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                           reason="the defects show only without Transformer Engine")


@pytest.fixture
def fake_cuda_machine_without_te(monkeypatch):
    """megatron-core as a fresh process on a GPU without TE sees it: no CPU shims,
    `te_general_gemm` undefined, MLA's TE flag set."""
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(multi_latent_attention, "HAVE_TE", True)
    monkeypatch.setattr(compat, "_applied", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pd, "_select_gpu", lambda local_rank: None)
    monkeypatch.setattr(pd, "apply_cpu_shims", lambda: pytest.fail("CPU shims applied on CUDA"))
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pd.dist, "init_process_group", lambda **kw: None)
    monkeypatch.setattr(pd.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(pd.dist, "get_world_size", lambda: 1)


@no_te
def test_init_distributed_on_cuda_fixes_the_router_gating(fake_cuda_machine_without_te):
    pd.init_distributed()
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)  # NameError without the fix
    torch.testing.assert_close(out, x @ w.t())
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(5, 4).t() @ x.detach())
    torch.testing.assert_close(x.grad, torch.ones(5, 4) @ w.detach())
    assert compat.apply_library_fixes() == ["router_gemm", "mla_te_flag"]


@no_te
def test_init_distributed_on_cuda_clears_mla_te_flag(fake_cuda_machine_without_te):
    with pytest.raises(TypeError):  # what MLASelfAttention.__init__ runs into
        isinstance(object(), multi_latent_attention.TELinear)
    pd.init_distributed()
    assert multi_latent_attention.HAVE_TE is False


def test_fixes_leave_a_megatron_core_without_the_defect_alone(monkeypatch):
    """megatron-core 0.17+ (or TE installed) defines the names: nothing is replaced."""
    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    monkeypatch.setattr(multi_latent_attention, "HAVE_TE", False)
    monkeypatch.setattr(compat, "_applied", [])
    assert compat.apply_library_fixes() == []
    assert moe_utils.te_general_gemm is sentinel


def test_every_fix_is_in_the_table():
    for fix in compat.FIXES:
        assert f"| {fix.name} |" in compat.__doc__, f"{fix.name} missing from the table"
