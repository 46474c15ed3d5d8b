"""In-flight weight updates: read and check new weights, then copy them in one go.

`stage_update(targets, source)` does everything that can fail (reading a
checkpoint, matching names, shapes, dtypes, finiteness, delta indices)
before anything is written, and returns the cheap in-place copy that the
engine runs under its step lock, so a bad source changes nothing and a good
one lands between two decode steps.

Sources:
    None                       the model was changed in place (shared with a trainer)
    {name: tensor}             a state dict: our global names (checkpoints, `model_state_dict`)
                               or the model's own `state_dict()` names; any subset
    "path"                     a megatron-composer checkpoint root or iter_XXXXXXX dir
    {name: {"indices", "values"}}  a delta: flat indices into the tensor and their new values

A `weight_sync.WeightUpdate` (the format RL publishes, in process, through
Ray and over HTTP) is rebuilt into a state dict by its subscriber;
`check_layout` checks its names, shapes and dtypes against the model before
anything is decompressed.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..checkpoint import CheckpointError, load_tensors, locate_checkpoint, tensor_specs


def _is_delta(source: dict) -> bool:
    return bool(source) and all(isinstance(v, dict) for v in source.values())


def _read_checkpoint(path: str, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not os.path.exists(path):
        raise ValueError(f"no checkpoint at {path}; give a checkpoint root or an iter_XXXXXXX directory")
    try:
        it_dir = locate_checkpoint(path).dir
        stored = tensor_specs(it_dir)
    except (CheckpointError, OSError) as exc:  # every unreadable checkpoint is one clear error
        raise ValueError(f"cannot read a checkpoint at {path}: {exc}") from exc
    missing = [n for n in targets if n not in stored]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} of the model's tensors (first: {missing[0]}); "
                         f"it was saved from a different model")
    try:
        return load_tensors(it_dir, {n: stored[n] for n in targets})
    except CheckpointError as exc:
        raise ValueError(str(exc)) from exc


def _resolve(name: str, targets: dict, local_to_global: dict) -> str:
    if name in targets:
        return name
    if name in local_to_global:
        return local_to_global[name]
    raise ValueError(f"weight {name!r} is not a tensor of this model (e.g. {next(iter(targets))!r})")


def _check_kind(name: str, dtype: torch.dtype, target: torch.Tensor) -> None:
    if target.is_floating_point() and not dtype.is_floating_point:
        raise ValueError(f"weight {name!r} is {dtype}; the model's is {target.dtype}: send floating-point values")


def check_layout(targets: dict[str, torch.Tensor], layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 local_to_global: dict | None = None) -> None:
    """Raise ValueError unless every {name: (shape, dtype)} of `layout` names a tensor of `targets`
    (global or local name) with that shape and a dtype that can hold it."""
    local_to_global = local_to_global or {}
    for name, (shape, dtype) in layout.items():
        target = targets[_resolve(name, targets, local_to_global)]
        if tuple(shape) != tuple(target.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}; the model's is {tuple(target.shape)}")
        _check_kind(name, dtype, target)


def _check_tensor(name: str, value, target: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}; the model's is {tuple(target.shape)}")
    _check_kind(name, value.dtype, target)
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ValueError(f"weight {name!r} has NaN or Inf values; refusing the update")
    return value


def _check_delta(name: str, change, target: torch.Tensor):
    if set(change) != {"indices", "values"}:
        raise ValueError(f"delta for {name!r} has keys {sorted(change)}; give exactly 'indices' and 'values'")
    indices = torch.as_tensor(change["indices"])
    if isinstance(change["values"], torch.Tensor):
        _check_kind(name, change["values"].dtype, target)
    values = torch.as_tensor(change["values"], dtype=target.dtype)
    if indices.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"delta indices for {name!r} are {indices.dtype}; give integer flat indices")
    indices = indices.reshape(-1).long()
    values = values.reshape(-1)
    if indices.numel() != values.numel():
        raise ValueError(f"delta for {name!r} has {indices.numel()} indices but {values.numel()} values")
    if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < target.numel()):
        raise ValueError(f"delta indices for {name!r} must be in [0, {target.numel()}) (flat); got "
                         f"{int(indices.min())} .. {int(indices.max())}")
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        raise ValueError(f"delta values for {name!r} have NaN or Inf; refusing the update")
    return indices, values


def stage_update(targets: dict[str, torch.Tensor], source, local_to_global: dict | None = None) -> Callable[[], None]:
    """Check `source` against `targets` (global name -> the model's tensor, sharing storage) and
    return the function that writes it. Raises ValueError, writing nothing, for a bad source."""
    local_to_global = local_to_global or {}
    if source is None:
        return lambda: None
    if isinstance(source, (str, os.PathLike)):
        source = _read_checkpoint(os.fspath(source), targets)
    if not isinstance(source, dict) or not source:
        raise ValueError(f"weights source must be a state dict, a delta, a checkpoint path or None; got "
                         f"{type(source).__name__ if not isinstance(source, dict) else 'an empty dict'}")
    writes = []
    if _is_delta(source):
        for name, change in source.items():
            key = _resolve(name, targets, local_to_global)
            target = targets[key]
            if not target.is_contiguous():
                raise ValueError(f"weight {name!r} is not contiguous; send it whole instead of a delta")
            indices, values = _check_delta(name, change, target)
            writes.append((target, indices.to(target.device), values.to(target.device)))

        def apply_delta():
            for target, indices, values in writes:
                target.view(-1).index_copy_(0, indices, values)

        return apply_delta
    for name, value in source.items():
        key = _resolve(name, targets, local_to_global)
        writes.append((targets[key], _check_tensor(name, value, targets[key]).to(targets[key].device)))

    def apply_state():
        for target, value in writes:
            target.copy_(value)

    return apply_state
