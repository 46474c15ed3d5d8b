"""Expert weights quantized once per optimizer step, not once per micro-batch.

A quantized expert GEMM needs two operands of its weight w [out, in]: the
forward's `fake_quantize(w, precision)` and the dgrad's MXFP8 copy of w.T,
blocked along `out` (`quant/gemm.py`). Both depend on w alone, which changes
only when the optimizer updates it, so `WeightQuantCache` keeps them in their
compact quantized form (NVFP4: 4.5 bits per weight element plus an fp32
scale per row, MXFP8: 8.25 bits; both operands together about 1.6 bytes per
element with nvfp4 experts, 2.1 with mxfp8) and dequantizes them at each
use, which gives the same values as quantizing afresh.

When a cached operand is stale. The cache key of a weight is
    (optimizer-step generation, data_ptr, _version, shape, dtype, device).
`_version` counts in-place writes through the parameter itself (an optimizer
updating it in place, `load_state_dict`, the fp32 main -> bf16 model copy in
`optim/builder.py`); data_ptr catches a parameter whose `.data` is replaced
(`.to()`, `.cuda()`). Neither sees writes that bypass the parameter's own
version counter: `param.data.copy_(...)`, a distributed optimizer writing
through a flat parameter buffer, an FSDP all-gather into the unsharded
storage. For those every `torch.optim.Optimizer.step()` in the process bumps
the generation (a global step post-hook, registered at import), which makes
every cached weight stale; a skipped step (non-finite gradients) runs no
optimizer and keeps them. Code that rewrites weights outside an optimizer
and behind the version counter calls `invalidate_quantized_weights()`.
Checking the key reads Python ints and tensor metadata only: no host sync.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import ops
from .formats import MXFP8Tensor, NVFP4Tensor

_generation = 0


def invalidate_quantized_weights(*_unused) -> None:
    """Make every cached quantized weight stale (it is re-quantized at its next use)."""
    global _generation
    _generation += 1


# every optimizer step may have rewritten any weight, through paths no version counter sees
register_optimizer_step_post_hook(invalidate_quantized_weights)


def quantize_weight(weight: torch.Tensor, fmt: str) -> MXFP8Tensor | NVFP4Tensor:
    """Quantize one weight operand; the one place the cache quantizes (tests count the calls)."""
    return ops.quantize(weight, fmt)


class QuantizedWeight:
    """The quantized operands of one weight w [out, in] at one value of w.

    `forward(w, precision)` is `fake_quantize(w, precision, float32)` [out,
    in], `dgrad(w)` is `fake_quantize(w.T, "mxfp8", float32)` [in, out]; each
    is quantized on first use and dequantized at every use. `w` is the weight
    the key was taken from (the caller's; no reference to it is kept, so a
    freed or resharded parameter is never held alive).
    """

    def __init__(self, key: tuple):
        self.key = key
        self._forward: dict[str, MXFP8Tensor | NVFP4Tensor] = {}
        self._dgrad: Optional[MXFP8Tensor] = None

    def forward(self, weight: torch.Tensor, precision: str) -> torch.Tensor:
        """[out, in] float32, the forward operand in `precision`."""
        if precision not in self._forward:
            self._forward[precision] = quantize_weight(weight.detach(), precision)
        return ops.dequantize(self._forward[precision], torch.float32)

    def dgrad(self, weight: torch.Tensor) -> torch.Tensor:
        """[in, out] float32, the dgrad operand: MXFP8 blocked along `out`."""
        if self._dgrad is None:
            # contiguous, as the uncached dgrad quantizes it (`gemm.mxfp8_dgrad`)
            self._dgrad = quantize_weight(weight.detach().t().contiguous(), "mxfp8")
        return ops.dequantize(self._dgrad, torch.float32)


def _key(weight: torch.Tensor) -> tuple:
    return (_generation, weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device)


class WeightQuantCache:
    """Per-module cache of one weight's `QuantizedWeight` (see the module docstring for staleness)."""

    def __init__(self):
        self._entry: Optional[QuantizedWeight] = None

    def get(self, weight: torch.Tensor) -> QuantizedWeight:
        """The QuantizedWeight of `weight` [out, in] as it is now, reused while its key holds."""
        key = _key(weight)
        if self._entry is None or self._entry.key != key:
            self._entry = QuantizedWeight(key)
        return self._entry

    def clear(self) -> None:
        self._entry = None
