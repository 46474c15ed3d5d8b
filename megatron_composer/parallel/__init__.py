"""Parallel layouts: the dense/expert meshes and the zigzag context-parallel split."""
from .layout import ParallelLayout
from .zigzag import (
    ZigzagLayout,
    cp_shift_left,
    pad_batch,
    shift_left,
    zigzag_batch,
    zigzag_chunks,
    zigzag_merge,
    zigzag_split,
)

__all__ = [
    "ParallelLayout",
    "ZigzagLayout",
    "cp_shift_left",
    "pad_batch",
    "shift_left",
    "zigzag_batch",
    "zigzag_chunks",
    "zigzag_merge",
    "zigzag_split",
]
