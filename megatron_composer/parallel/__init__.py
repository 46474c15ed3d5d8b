"""Parallel layouts: the dense/expert meshes and the zigzag context-parallel split.

`zigzag` is the index math, `zigzag_batch` applies it to a micro-batch,
`cp_shift` shifts labels across CP ranks.
"""
from .cp_shift import ShiftPlan, cp_shift_left, shift_left, shift_plan
from .layout import ParallelLayout
from .zigzag import (
    Segment,
    ZigzagLayout,
    check_divisible,
    padded_length,
    zigzag_chunks,
    zigzag_merge,
    zigzag_split,
)
from .zigzag_batch import PaddingPlan, document_padding, packed_seq_params_for, pad_batch, zigzag_batch

__all__ = [
    "PaddingPlan",
    "ParallelLayout",
    "Segment",
    "ShiftPlan",
    "ZigzagLayout",
    "check_divisible",
    "cp_shift_left",
    "document_padding",
    "packed_seq_params_for",
    "pad_batch",
    "padded_length",
    "shift_left",
    "shift_plan",
    "zigzag_batch",
    "zigzag_chunks",
    "zigzag_merge",
    "zigzag_split",
]
