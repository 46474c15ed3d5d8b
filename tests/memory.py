"""Memory probes for tests: the largest storage a block of torch ops creates."""
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestAllocation(TorchDispatchMode):
    """Bytes of the largest storage any aten op creates (outputs that are not one of its inputs),
    of `dtype` only when it is given; `ops` counts the ops seen."""

    def __init__(self, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.dtype = dtype
        self.largest, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and (self.dtype is None or t.dtype == self.dtype)
                    and t.untyped_storage().data_ptr() not in inputs):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        self.ops += 1
        return out
