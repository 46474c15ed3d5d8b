"""Which versions of megatron-core, Transformer Engine and torch megatron-composer runs with.

    package             checked                 accepted, with a note          refused
    megatron-core       0.16.1                  0.16.2 - 0.19.x on CUDA        older; 0.20 and newer; on CPU
                                                                               anything but 0.16.1
    transformer-engine  2.9 - 2.11              2.12 and newer                 older than 2.9
    torch               2.10 and newer          2.9 (on CUDA)                  older than 2.9

* megatron-core: the CPU backend (`platform.cpu`) patches megatron-core
  internals and is checked against 0.16.1 only, so CPU runs refuse any other
  release. CUDA runs apply no such patch: 0.17 - 0.19 (what Python 3.12
  clusters install; 0.17 and later need Python 3.12) are accepted with a
  note that they are untested. `platform.compat`'s fixes test for their
  defect, not for a version.
* Transformer Engine: 2.9 - 2.11 is what megatron-core 0.16.1 declares;
  newer releases (current NGC PyTorch containers) are accepted with a note.
  Older ones lack the FP8 block-scaling support matrix `platform.recipes`
  follows and are refused.
* torch: `torch._grouped_mm` (the grouped bf16 experts, `moe.grouped`) has a
  CPU kernel and fp32 / fp16 support from 2.9 (2.8: bf16 on CUDA only);
  `torch.nn.attention.varlen` (one flash call over packed documents,
  `attention.kernels`) arrives in 2.10, before which packed documents run
  one SDPA per document. The CPU build is pinned (`torch==2.13.0`, setup.py).

Every rule is a pure function of version strings (`*_verdict`); the doctor
prints the verdicts and `check_megatron_core_version` refuses at start-up.
"""
from __future__ import annotations

import importlib.metadata
import warnings
from dataclasses import dataclass
from typing import Optional

from packaging.version import InvalidVersion, Version

MEGATRON_CORE_CHECKED = "0.16.1"
MEGATRON_CORE_BELOW = "0.20"  # first release not accepted on CUDA
TE_MIN, TE_CHECKED_BELOW = "2.9", "2.12"
TORCH_MIN, TORCH_VARLEN = "2.9", "2.10"


class MegatronCoreVersionError(RuntimeError):
    pass


@dataclass(frozen=True)
class Verdict:
    """Whether a version runs (`ok`) and what to say about it (a note when ok, the problem when not)."""

    ok: bool
    note: Optional[str] = None


def _parse(version: str) -> Optional[Version]:
    try:
        return Version(version)
    except (InvalidVersion, TypeError):
        return None


def megatron_core_verdict(version: Optional[str], on_cuda: bool) -> Verdict:
    """megatron-core `version` (None: it does not import) on CUDA or on the CPU backend."""
    install = f"pip install megatron-core=={MEGATRON_CORE_CHECKED}"
    if version is None:
        return Verdict(False, f"megatron-core does not import; {install}")
    if version == MEGATRON_CORE_CHECKED:
        return Verdict(True)
    parsed = _parse(version)
    accepted = parsed is not None and Version(MEGATRON_CORE_CHECKED) < parsed < Version(MEGATRON_CORE_BELOW)
    if on_cuda and accepted:
        return Verdict(True, f"megatron-core {version} is accepted on CUDA but untested; megatron-composer is "
                             f"checked against {MEGATRON_CORE_CHECKED}")
    if accepted:  # on CPU
        return Verdict(False, f"megatron-core {version} is installed, but the CPU backend patches megatron-core "
                              f"internals checked against {MEGATRON_CORE_CHECKED} only ({MEGATRON_CORE_CHECKED} "
                              f"to <{MEGATRON_CORE_BELOW} runs on CUDA); on CPU {install}")
    return Verdict(False, f"megatron-core {version} is outside what megatron-composer runs with "
                          f"({MEGATRON_CORE_CHECKED}, or up to <{MEGATRON_CORE_BELOW} on CUDA); {install}")


def transformer_engine_verdict(version: Optional[str]) -> Verdict:
    """Transformer Engine `version` (None: not installed, which is fine: `--transformer-impl local`)."""
    if version is None:
        return Verdict(True)
    parsed = _parse(version)
    if parsed is None or parsed.release[:2] < Version(TE_MIN).release:
        return Verdict(False, f"transformer-engine {version} is older than {TE_MIN}, the oldest megatron-core "
                              f"{MEGATRON_CORE_CHECKED} supports; pip install -e '.[gpu]' (or uninstall it and "
                              f"use --transformer-impl local)")
    if parsed.release[:2] >= Version(TE_CHECKED_BELOW).release:
        return Verdict(True, f"transformer-engine {version} is newer than megatron-core {MEGATRON_CORE_CHECKED} "
                             f"declares (>={TE_MIN},<{TE_CHECKED_BELOW}); accepted, untested")
    return Verdict(True)


def torch_verdict(version: str, on_cuda: bool) -> Verdict:
    """torch `version` (e.g. "2.9.1+cu129") for a CUDA or a CPU run."""
    parsed = _parse(version)
    if parsed is None or parsed.release[:2] < Version(TORCH_MIN).release:
        return Verdict(False, f"torch {version} is older than {TORCH_MIN}: torch._grouped_mm (the grouped "
                              f"experts) has no CPU kernel and no fp32 path before it; install torch>={TORCH_MIN}")
    if on_cuda and parsed.release[:2] < Version(TORCH_VARLEN).release:
        return Verdict(True, f"torch {version} has no torch.nn.attention.varlen (torch>={TORCH_VARLEN}): "
                             f"packed documents run one SDPA call per document")
    return Verdict(True)


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of `distribution` (None: not installed); imports nothing."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_megatron_core_version(on_cuda: Optional[bool] = None) -> str:
    """Refuse a megatron-core that this device cannot run (`megatron_core_verdict`); warn
    once for an accepted, untested one. Returns the version."""
    import megatron.core
    import torch

    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    version = getattr(megatron.core, "__version__", "unknown")
    verdict = megatron_core_verdict(version, on_cuda)
    if not verdict.ok:
        raise MegatronCoreVersionError(verdict.note)
    if verdict.note:
        warnings.warn(verdict.note, stacklevel=2)
    return version
