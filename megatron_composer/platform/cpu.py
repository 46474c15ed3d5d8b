"""Run megatron-core 0.16.1 on CPU + gloo (and refuse any other release there: `platform.versions`).

megatron-core officially supports only CUDA + NCCL. Its model code is plain
PyTorch, except for a few places that reach for CUDA directly. Each shim
below replaces exactly one such place, is applied only when CUDA is absent,
and is checked by `tests/test_platform_cpu.py`. The table is the single
source of truth: `SHIMS` is built from it and `apply_cpu_shims` walks it.

| shim | megatron-core call site (0.16.1) | why it breaks on CPU | replacement |
|---|---|---|---|
| current_device | `torch.cuda.current_device()` in RoPE, router, MoE utils, DDP buffers | CUDA not compiled in | returns `torch.device("cpu")` |
| cuda_rng_state | `tensor_parallel.random` CUDA RNG tracker (`get/set_rng_state`, `manual_seed`) | CUDA RNG absent | the CPU default generator plays the CUDA generator (seed, fork and restore keep their semantics) |
| streams | `torch.cuda.Stream/stream/current_stream/Event`: alltoall dispatcher DtoH stream, DDP overlap | no CUDA streams | no-op stream/event objects (CPU ops are synchronous) |
| synchronize | `torch.cuda.synchronize()` (timers, dist-checkpoint async writer) | CUDA absent | no-op |
| memory_stats | `torch.cuda.memory_allocated/max_memory_allocated/...` (memory reports) | CUDA absent | report 0 |
| tensor_cuda | `Tensor.cuda()` / `Tensor.to("cuda")` on small bookkeeping tensors | CUDA absent | stays on CPU |
| device_cuda_literal | `torch.zeros/empty/ones/tensor/arange(..., device="cuda")` | CUDA absent | allocates on CPU |
| alltoall_splits | `moe_utils.maybe_move_tensor_to_cpu` gives the alltoall dispatcher its split sizes | gloo `all_to_all_single` needs Python ints, not a tensor | converts the split tensor to a list |
| router_gemm_torch | `moe_utils.RouterGatingLinearFunction` calls TE's `te_general_gemm` whenever TE imports | TE's GEMM takes CUDA tensors only (a CPU run on a machine with TE, e.g. `CUDA_VISIBLE_DEVICES=`) | `te_general_gemm = None`: megatron's own torch.mm path |
| torch_compile | `torch.compile` on megatron helpers (e.g. `TopKRouter._apply_expert_bias`) | compiles with the C++ toolchain on first use, ~5 CPU-seconds per process, no gain at CPU sizes | dynamo disabled (eager, same results); `MEGATRON_COMPOSER_CPU_COMPILE=1` keeps it |

megatron-core's defects without Transformer Engine (the router's
`te_general_gemm`, MLA's `HAVE_TE`) break CUDA runs too; `platform.compat`
fixes them on every device. Anything in neither table is a bug to report, not
to patch silently.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .versions import MegatronCoreVersionError, check_megatron_core_version

__all__ = ["MegatronCoreVersionError", "SHIMS", "apply_cpu_shims", "applied_shims", "check_megatron_core_version"]


@dataclass(frozen=True)
class Shim:
    name: str
    apply: Callable[[], None]


class _NoStream:
    """Stands in for `torch.cuda.Stream`: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    def __hash__(self):
        return 0


class _NoEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare CUDA ordinal


def _shim_current_device():
    torch.cuda.current_device = lambda: _CPU


def _shim_cuda_rng_state():
    # The "CUDA generator" becomes the CPU default generator, so megatron's
    # RNG tracker (seed, fork, restore) keeps its exact semantics.
    def get_state(device="cuda"):
        return torch.get_rng_state()

    def set_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    def manual_seed(seed):
        # not torch.manual_seed: it calls torch.cuda.manual_seed_all itself
        torch.default_generator.manual_seed(int(seed))

    for module in (torch.cuda, torch.cuda.random):
        module.get_rng_state = get_state
        module.set_rng_state = set_state
        module.manual_seed = manual_seed
        module.manual_seed_all = manual_seed
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: set_state(new_state)


def _shim_streams():
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.default_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _shim_synchronize():
    torch.cuda.synchronize = lambda device=None: None


def _shim_memory_stats():
    for name in (
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
    ):
        setattr(torch.cuda, name, lambda device=None: 0)


def _shim_tensor_cuda():
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kw: self
    original_to = torch.Tensor.to

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]) and not isinstance(args[0], int):
            args = (_CPU,) + args[1:]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint", "zeros_like", "empty_like", "ones_like")


def _shim_device_cuda_literal():
    # `with torch.device(...)` finds factories by identity through a set cached
    # on first use; cache the real factories before wrapping them, or device
    # contexts (e.g. "meta" in transformers' from_pretrained) stop applying.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        original = getattr(torch, name)

        def make(original):
            @functools.wraps(original)
            def factory(*args, **kwargs):
                if _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = _CPU
                return original(*args, **kwargs)

            return factory

        setattr(torch, name, make(original))


def _shim_alltoall_splits():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # The original converts only CUDA tensors; on CPU the split sizes must
        # still become numpy arrays, which gloo's all_to_all_single accepts.
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _shim_router_gemm_torch():
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _shim_torch_compile():
    import os

    if os.environ.get("MEGATRON_COMPOSER_CPU_COMPILE") != "1":
        import torch._dynamo

        torch._dynamo.config.disable = True


SHIMS: tuple[Shim, ...] = (
    Shim("current_device", _shim_current_device),
    Shim("cuda_rng_state", _shim_cuda_rng_state),
    Shim("streams", _shim_streams),
    Shim("synchronize", _shim_synchronize),
    Shim("memory_stats", _shim_memory_stats),
    Shim("tensor_cuda", _shim_tensor_cuda),
    Shim("device_cuda_literal", _shim_device_cuda_literal),
    Shim("alltoall_splits", _shim_alltoall_splits),
    Shim("router_gemm_torch", _shim_router_gemm_torch),
    Shim("torch_compile", _shim_torch_compile),
)

_applied: list[str] = []


def apply_cpu_shims(force: bool = False) -> list[str]:
    """Apply every shim once (no-op with CUDA unless `force`); return the names applied."""
    if torch.cuda.is_available() and not force:
        return []
    if _applied:
        return list(_applied)
    check_megatron_core_version(on_cuda=False)
    for shim in SHIMS:
        shim.apply()
        _applied.append(shim.name)
    return list(_applied)


def applied_shims() -> list[str]:
    return list(_applied)
