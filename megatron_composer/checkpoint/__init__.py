"""Distributed checkpoints: torch.distributed.checkpoint (DCP), atomic, verified, reshardable.

    tracker.py    directory layout, the tracker, what a path holds, fsync helpers
    integrity.py  per-file xxh3 checksums written at save, verified at load
    rng.py        the random state of each rank (CPU, CUDA, megatron's RNG tracker)
    state.py      model / optimizer state under layout-independent names
    io.py         save_checkpoint, load_checkpoint, start-up checks

Sits below `training/` and `convert/`; imports only `parallel/` of ours.
"""
from .io import check_save_dir, load_checkpoint, read_extra_file, remove_stale_tmp, save_checkpoint
from .state import (
    expected_checkpoint_bytes,
    global_param_names,
    load_model_state_dict,
    load_optimizer_state_dict,
    model_state_dict,
    optimizer_state_dict,
)
from .tracker import (
    TRACKER,
    CheckpointError,
    CheckpointSaveError,
    is_checkpoint_dir,
    iteration_dir,
    latest_iteration,
    load_target_kind,
    read_meta,
)

__all__ = [
    "TRACKER",
    "CheckpointError",
    "CheckpointSaveError",
    "check_save_dir",
    "expected_checkpoint_bytes",
    "global_param_names",
    "is_checkpoint_dir",
    "iteration_dir",
    "latest_iteration",
    "load_checkpoint",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "load_target_kind",
    "model_state_dict",
    "optimizer_state_dict",
    "read_extra_file",
    "read_meta",
    "remove_stale_tmp",
    "save_checkpoint",
]
