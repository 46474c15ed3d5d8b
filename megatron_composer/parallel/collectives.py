"""Tensor collectives under their current torch names.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
`all_gather_single` / `reduce_scatter_single` (the old names warn); CUDA
installs may carry an older torch that has only the old names.
"""
from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
