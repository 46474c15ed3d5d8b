"""Write our DCP checkpoints without holding the whole model.

`checkpoint.save_checkpoint` saves a model that is already in memory. A
converter must not need that, so:

* `save_lazily` runs `torch.distributed.checkpoint.save` on a state dict of
  `meta` tensors (DCP plans from shapes and dtypes alone) and produces each
  real tensor only when the writer asks for it, through the planner's
  `resolve_data` hook. The stock `FileSystemWriter` keeps every tensor of a
  file alive until the file is closed, so `_BoundedFileWriter` starts a new
  `.distcp` file every `max_file_bytes`; peak memory is about one file.

The result is an ordinary DCP checkpoint: `checkpoint.load_checkpoint`
reads it, under any expert-parallel size, and `checkpoint.load_tensors` reads
a chosen subset of its tensors back.
"""
from __future__ import annotations

import queue
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .config import ConversionError

PREFIX = "model."  # checkpoint.save_checkpoint stores {"model": {...}}


class _LazySavePlanner(DefaultSavePlanner):
    def __init__(self, produce: Callable[[str], torch.Tensor], on_tensor: Optional[Callable[[int], None]]):
        super().__init__()
        self._produce = produce
        self._on_tensor = on_tensor

    def resolve_data(self, write_item):
        name = write_item.index.fqn[len(PREFIX):]
        tensor = self._produce(name)
        planned = write_item.tensor_data
        if tuple(tensor.shape) != tuple(planned.size) or tensor.dtype != planned.properties.dtype:
            raise ConversionError(
                f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned "
                f"{tuple(planned.size)} {planned.properties.dtype}"
            )
        if self._on_tensor:
            self._on_tensor(tensor.numel() * tensor.element_size())
        return tensor


class _BoundedFileWriter(FileSystemWriter):
    """FileSystemWriter whose files hold at most ~max_file_bytes of tensors each."""

    def __init__(self, path: str, max_file_bytes: int):
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.max_file_bytes = max_file_bytes

    def write_data(self, plan, planner):
        prefix = plan.storage_data.prefix
        files: list[list] = []
        size = self.max_file_bytes + 1
        for item in plan.items:
            nbytes = item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
            if size + nbytes > self.max_file_bytes and (not files or files[-1]):
                files.append([])
                size = 0
            files[-1].append(item)
            size += nbytes
        file_queue: queue.Queue = queue.Queue()
        for i, items in enumerate(files):
            name = f"{prefix}{i}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, file_queue)


def save_lazily(
    path: str,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    max_file_bytes: int,
    on_tensor: Optional[Callable[[int], None]] = None,
) -> None:
    """Write a DCP checkpoint of `{"model": {name: produce(name)}}`.

    Args:
        specs: name -> (shape, dtype) of every tensor, in the order to write.
        produce: returns the tensor for a name; called once per name.
        max_file_bytes: bound on the tensor bytes of one `.distcp` file.
    """
    state = {"model": {name: torch.empty(shape, dtype=dtype, device="meta")
                       for name, (shape, dtype) in specs.items()}}
    with _unwrapped_errors():
        dcp.save(state, storage_writer=_BoundedFileWriter(path, max_file_bytes),
                 planner=_LazySavePlanner(produce, on_tensor))


@contextmanager
def _unwrapped_errors():
    """Re-raise the error DCP wrapped into a CheckpointException (a BaseException,
    which `except Exception` would not see)."""
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
            yield
    except CheckpointException as exc:
        failures = list(exc.failures.values())
        if len(failures) == 1 and isinstance(failures[0][0], BaseException):
            raise failures[0][0] from None
        raise ConversionError(str(exc)) from None
