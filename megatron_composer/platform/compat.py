"""Fix megatron-core's own defects where Transformer Engine is absent, on any device.

megatron-core 0.16.1 guards its TE-only code with names and flags that are
wrong when TE is not installed, so a run with `--transformer-impl local` on a
GPU without TE dies in megatron-core's model code. These are library bugs,
not CPU limitations: `platform.init_distributed` applies the fixes on CUDA
and on CPU alike (the CPU shims of `platform.cpu` are a separate table).

| fix | megatron-core call site (0.16.1) | defect without TE | replacement |
|---|---|---|---|
| router_gemm | `moe_utils.RouterGatingLinearFunction` tests `te_general_gemm is not None` | the import block that defines the name fails, so the first MoE forward raises NameError | define it as `None`, selecting megatron's own torch.mm path |
| mla_te_flag | `MLASelfAttention.__init__`: `HAVE_TE and isinstance(linear_proj, TELinear)` | the TE extension module imports without TE and hands MLA mock stand-ins, so `HAVE_TE` is True and `isinstance` raises TypeError | `HAVE_TE = False` |

Each fix tests for its defect rather than for a version, so it does nothing
where megatron-core is fixed (0.17 and later take both from the extension
module's own `HAVE_TE`) or where Transformer Engine is installed.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

_applied: list[str] = []


def _transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _router_gemm_defect() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def _fix_router_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _mla_te_flag_defect() -> bool:
    from megatron.core.transformer import multi_latent_attention

    return bool(getattr(multi_latent_attention, "HAVE_TE", False)) and not _transformer_engine_installed()


def _fix_mla_te_flag() -> None:
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


@dataclass(frozen=True)
class Fix:
    name: str
    present: Callable[[], bool]  # whether the installed megatron-core has the defect here
    apply: Callable[[], None]


FIXES: tuple[Fix, ...] = (
    Fix("router_gemm", _router_gemm_defect, _fix_router_gemm),
    Fix("mla_te_flag", _mla_te_flag_defect, _fix_mla_te_flag),
)


def apply_library_fixes() -> list[str]:
    """Apply every fix whose defect is present (once); return the names applied so far."""
    for fix in FIXES:
        if fix.name not in _applied and fix.present():
            fix.apply()
            _applied.append(fix.name)
    return list(_applied)
