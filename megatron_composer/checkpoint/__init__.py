"""Distributed checkpoints: torch.distributed.checkpoint (DCP), atomic, verified, reshardable.

    tracker.py    directory layout, the tracker, what a path holds (`locate_checkpoint`,
                  `checkpoint_tokenizer`), fsync helpers
    integrity.py  per-file xxh3 checksums written at save, verified at load
    rng.py        the random state of each rank (CPU, CUDA, megatron's RNG tracker)
    state.py      model / optimizer state under layout-independent names
    io.py         save_checkpoint, load_checkpoint, reading chosen tensors, start-up checks
    guard.py      a --save holding another run: refused, or moved aside (--overwrite-save)

Sits below `training/` and `convert/`; imports only `parallel/` of ours.
"""
from .guard import OVERWRITTEN_PREFIX, held_iterations
from .io import (
    check_save_dir,
    guard_save_dir,
    load_checkpoint,
    load_tensors,
    read_extra_file,
    remove_stale_tmp,
    save_checkpoint,
    tensor_specs,
)
from .state import (
    expected_checkpoint_bytes,
    global_param_names,
    load_model_state_dict,
    load_optimizer_state_dict,
    model_state_dict,
    optimizer_state_dict,
)
from .tracker import (
    TIKTOKEN_MODEL,
    TOKENIZER_CONFIG,
    TOKENIZER_MODEL,
    TRACKER,
    CheckpointError,
    CheckpointLocation,
    CheckpointSaveError,
    checkpoint_tokenizer,
    is_checkpoint_dir,
    iteration_dir,
    latest_iteration,
    load_target_kind,
    locate_checkpoint,
    read_meta,
)

__all__ = [
    "TIKTOKEN_MODEL",
    "TOKENIZER_CONFIG",
    "TOKENIZER_MODEL",
    "TRACKER",
    "CheckpointError",
    "CheckpointLocation",
    "CheckpointSaveError",
    "OVERWRITTEN_PREFIX",
    "check_save_dir",
    "checkpoint_tokenizer",
    "expected_checkpoint_bytes",
    "global_param_names",
    "guard_save_dir",
    "held_iterations",
    "is_checkpoint_dir",
    "iteration_dir",
    "latest_iteration",
    "load_checkpoint",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "load_target_kind",
    "load_tensors",
    "locate_checkpoint",
    "model_state_dict",
    "optimizer_state_dict",
    "read_extra_file",
    "read_meta",
    "remove_stale_tmp",
    "save_checkpoint",
    "tensor_specs",
]
