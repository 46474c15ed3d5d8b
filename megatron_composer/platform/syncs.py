"""Count the host syncs of a piece of work: every point where the host waits for the GPU.

A training step on CUDA should queue kernels and never wait for them, except
where it truly needs a value (the logged losses, the finite-gradient check).
`count_host_syncs()` lists every wait inside its `with` block, with the op and
the innermost megatron_composer / megatron-core line that caused it:

    with count_host_syncs() as syncs:
        trainer.train_step(batches)
    print(syncs)   # 3 (1 x Tensor.tolist at megatron_composer/training/trainer.py:251; ...)

What counts, and where it is seen (torch's own interception points):

1. torch-function level (`TorchFunctionMode`), reads of device values on the
   host: `Tensor.item`, `bool`/`int`/`float`/`index` of a tensor,
   `Tensor.tolist`, `Tensor.numpy`, `Tensor.cpu`; `Tensor.to` across host and
   device without `non_blocking` (a blocking copy *to* the GPU waits for the
   stream too: CUDA synchronizes after a pageable transfer);
   `torch.tensor(data, device=...)`, a blocking copy of Python data.
2. dispatch level (`TorchDispatchMode`, so backward and the insides of
   composite ops are seen): every aten op torch tags as data-dependent
   (`Tag.data_dependent_output`: `_local_scalar_dense`) or of data-dependent
   shape (`Tag.dynamic_output_shape`: `nonzero`, `masked_select`, `unique*`,
   `bincount`, ...), narrowed where the tag is broader than the sync: `index` /
   `index_put_` only with a boolean index (and `index_put_` not where torch
   runs it as `masked_fill_`: one mask, one host scalar, no accumulation),
   `repeat_interleave` only without `output_size`, `one_hot` only without
   `num_classes`; plus `aten.equal` (a bool) and cross-device `_to_copy` /
   `copy_` without `non_blocking`. An op counted at level 1 is not counted
   again by the aten ops it runs (`tolist` on CUDA copies to the host inside).
3. explicit waits, which are not torch ops: `torch.cuda.synchronize()`,
   `Event.synchronize()`, `Stream.synchronize()` (megatron's alltoall token
   dispatcher waits on its device-to-host event this way), wrapped for the
   duration of the block.

Which tensors count: only reads of *device* tensors are syncs; reading host
data while the GPU runs waits for nothing. On a GPU that is the tensor's
device. Without a GPU the CPU plays the device and host and device memory are
the same, so the counter tells them apart by how the code names them, as it
would run on a GPU:

- host data is what a torch factory makes without a `device` argument or
  with the string "cpu" (`torch.tensor(...)`, `torch.arange(n)`, torch.optim's
  step counters), and everything computed from host data only;
- every other tensor is device data (a `torch.device` value is the device the
  code runs on: what `x.device` or the trainer's device hold on a GPU);
- `.to()` of host data to a device is a host-to-device copy; `.to("cpu")` or
  `.cpu()` of device data is a device-to-host copy (`.to(torch.device("cpu"))`
  reads as the device, a miss; write "cpu").

Host data is recognized only if a counter (or `track_host_tensors()`) is open
when it is made: open one around building the trainer and its first step,
then count a step from micro-batches built outside it (their tensors are then
device data, as after `Batch.to` on a GPU). Also not seen without a GPU:
copies between two existing tensors with `copy_`, and device-to-host copies
that a CPU shim of `platform/cpu.py` turns into no-ops (megatron's
`maybe_move_tensor_to_cpu`; its wait on the copy, `Event.synchronize`, is
counted).
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from . import cpu as cpu_shims

_aten = torch.ops.aten
# torch.tensor itself, also where the CPU shims have wrapped the name `torch.tensor`
_TENSOR_FROM_DATA = torch._C._VariableFunctions.tensor

# level 1: reads of a tensor's values on the host
_READS = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.__bool__: "bool(Tensor)",
    torch.Tensor.__int__: "int(Tensor)",
    torch.Tensor.__float__: "float(Tensor)",
    torch.Tensor.__index__: "index(Tensor)",
}
_SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_BOOL_INDEX_OPS = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
                   _aten._index_put_impl_.default}
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default}
# the packages whose lines a sync is attributed to (innermost frame first)
_SOURCE_PACKAGES = ("megatron_composer", "megatron")
# frames that stand in for torch itself: this file and the CPU shims
_SKIP_FILES = {os.path.normcase(os.path.abspath(f)) for f in (__file__, cpu_shims.__file__)}
# Host tensors made while any counter was open (they stay host data after it closes).
_HOST_TENSORS = WeakIdKeyDictionary()


@dataclass(frozen=True)
class HostSync:
    """One kind of sync at one place: `op` ("Tensor.tolist", "aten.nonzero") at
    `source` ("megatron_composer/training/trainer.py:251")."""

    op: str
    source: str


@dataclass
class HostSyncs:
    """The syncs of a counted block, in the order they happened."""

    syncs: list[HostSync] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.syncs)

    def by_source(self) -> list[tuple[HostSync, int]]:
        """Each distinct (op, source) with how many times it synced, in first-seen order."""
        return list(Counter(self.syncs).items())

    def __str__(self) -> str:
        if not self.syncs:
            return "0"
        parts = "; ".join(f"{n} x {s.op} at {s.source}" for s, n in self.by_source())
        return f"{self.total} ({parts})"


def _source() -> str:
    """file:line of the innermost caller frame in megatron_composer or megatron-core
    (the innermost frame outside torch and this file when none is)."""
    fallback = None
    for frame, line in traceback.walk_stack(None):
        path = os.path.normcase(os.path.abspath(frame.f_code.co_filename))
        if path in _SKIP_FILES:
            continue
        parts = path.split(os.sep)
        for i in range(len(parts) - 1, -1, -1):
            if parts[i] in _SOURCE_PACKAGES:
                return f"{'/'.join(parts[i:])}:{line}"
        if fallback is None and f"{os.sep}torch{os.sep}" not in path:
            fallback = f"{os.path.basename(path)}:{line}"
    return fallback or "?"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _bool_index(indices) -> bool:
    return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)


def _masked_fill_path(args, kwargs) -> bool:
    """Whether `index_put_(self, indices, value, accumulate)` runs as `masked_fill_` (no sync):
    one bool mask, a single host value (a Python scalar arrives as a 0-dim CPU tensor),
    no accumulation."""
    indices, value = args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    masks = [t for t in indices if t is not None]
    return (not accumulate and len(masks) == 1 and masks[0].dtype in (torch.bool, torch.uint8)
            and value.numel() == 1 and value.device.type == "cpu" and value.dim() == 0)


class _Counter:
    """State shared by the two modes: the device, the record (None: only track host
    tensors), and whether an op counted at level 1 is running (its aten ops are not
    counted again)."""

    def __init__(self, device: torch.device, record: Optional[HostSyncs]):
        self.device = device
        self.record = record
        self.inside_counted = 0

    @property
    def stand_in(self) -> bool:
        """No GPU: the CPU plays the device, host data is known by its origin."""
        return self.device.type == "cpu"

    def is_host(self, t: torch.Tensor) -> bool:
        if self.stand_in:
            return t in _HOST_TENSORS
        return t.device.type != self.device.type

    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and not self.is_host(t)

    def mark_host(self, out) -> None:
        if self.stand_in:
            for t in _tensors(out):
                _HOST_TENSORS[t] = True

    def crosses(self, t: torch.Tensor, target, spelled: object = None) -> bool:
        """Whether `t.to(target)` copies between host and device; `spelled` is the
        target as the caller wrote it (it decides on the stand-in)."""
        if target is None:
            return False
        target = torch.device(target)
        if self.stand_in:
            return self.is_host(t) or _names_host(spelled)
        return t.device.type != target.type and self.device.type in (t.device.type, target.type)

    def add(self, op: str) -> None:
        if self.record is not None:
            self.record.syncs.append(HostSync(op, _source()))

    @contextlib.contextmanager
    def counted(self, op: Optional[str]):
        """Count `op` (None: nothing), and nothing that runs inside the block."""
        if op is not None:
            self.add(op)
        self.inside_counted += op is not None
        try:
            yield
        finally:
            self.inside_counted -= op is not None

    @contextlib.contextmanager
    def quiet(self):
        """Count nothing that runs inside the block."""
        self.inside_counted += 1
        try:
            yield
        finally:
            self.inside_counted -= 1


def _names_host(device) -> bool:
    """On the stand-in: whether a device argument, as written, names the host (the
    string "cpu"); a `torch.device` value is the device the code runs on."""
    return isinstance(device, str) and torch.device(device).type == "cpu"


def _spelled_target(args, kwargs):
    """The device argument of `Tensor.to(*args, **kwargs)` as written (None: no device)."""
    if "device" in kwargs:
        return kwargs["device"]
    return args[0] if args and isinstance(args[0], (str, torch.device, int)) else None


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def _copy(self, func, args, kwargs) -> tuple[bool, bool]:
        """(crosses between host and device, non_blocking) of a `Tensor.to` / `Tensor.cpu`."""
        c, t = self.counter, args[0]
        if not isinstance(t, torch.Tensor):
            return False, False
        if func is torch.Tensor.cpu:
            return c.is_device(t) and c.crosses(t, "cpu", "cpu"), False
        target, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        return c.crosses(t, target, _spelled_target(args[1:], kwargs)), non_blocking

    def _sync_op(self, func, args, kwargs) -> Optional[str]:
        c = self.counter
        if c.inside_counted:
            return None
        if func in _READS:
            return _READS[func] if c.is_device(args[0]) else None
        if func is torch.Tensor.cpu:
            return "Tensor.cpu" if self._copy(func, args, kwargs) == (True, False) else None
        if func is torch.Tensor.to:
            crossing, non_blocking = self._copy(func, args, kwargs)
            if not crossing or non_blocking:
                return None
            return "Tensor.to(host to device)" if c.is_host(args[0]) else "Tensor.to(device to host)"
        if func is _TENSOR_FROM_DATA:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == c.device.type \
                    and not (c.stand_in and _names_host(target)):
                return "torch.tensor(device=...)"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        op = self._sync_op(func, args, kwargs)
        with c.counted(op):
            out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        if func in (torch.Tensor.to, torch.Tensor.cpu) and self._copy(func, args, kwargs)[0]:
            if c.stand_in and out is not args[0]:  # a new tensor on the other side of the copy
                if c.is_host(args[0]):
                    _HOST_TENSORS.pop(out, None)
                else:
                    c.mark_host(out)
        elif not inputs and _names_host(kwargs.get("device", _default_device())):
            c.mark_host(out)  # a factory on the host: no device, or "cpu" as written
        elif c.stand_in and inputs and "device" not in kwargs and all(c.is_host(t) for t in inputs):
            # computed from host data only; seen here as well as at the dispatch level,
            # where Python numbers have become tensors that look like device data
            c.mark_host(out)
        return out


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def _syncs(self, func, args, kwargs) -> bool:
        c = self.counter
        if func in _COPY_OPS:
            if c.stand_in:  # judged at level 1, where the target is still visible
                return False
            if func is _aten.copy_.default:
                src, target = args[1], args[0].device
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            else:
                src, target = args[0], kwargs.get("device")
                non_blocking = kwargs.get("non_blocking", False)
            return not non_blocking and c.crosses(src, target)
        if not c.is_device(args[0]):
            return False
        if func in _BOOL_INDEX_OPS:
            return _bool_index(args[1]) and not (func is not _aten.index.Tensor
                                                 and _masked_fill_path(args, kwargs))
        if not (func is _aten.equal.default or any(t in func.tags for t in _SYNC_TAGS)):
            return False
        if func is _aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        if func is _aten.one_hot.default:
            num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            return num_classes < 0
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        if not c.inside_counted and c.record is not None and self._syncs(func, args, kwargs):
            c.add(f"aten.{func.overloadpacket.__name__}")
        out = func(*args, **kwargs)
        if c.stand_in:
            inputs = _tensors((args, kwargs))
            if inputs and all(c.is_host(t) for t in inputs):
                c.mark_host(out)  # computed from host data only
        return out


@contextlib.contextmanager
def _count_waits(counter: _Counter):
    """Wrap the explicit waits (level 3) for the block: the CUDA ones, or the CPU shims'
    stand-ins (`platform/cpu.py`) without a GPU."""
    targets = [(torch.cuda, "synchronize", "torch.cuda.synchronize"),
               (torch.cuda.Event, "synchronize", "Event.synchronize"),
               (torch.cuda.Stream, "synchronize", "Stream.synchronize")]
    with contextlib.ExitStack() as stack:
        for owner, name, op in targets:
            original = getattr(owner, name)

            def wait(*args, _original=original, _op=op, **kwargs):
                counter.add(_op)
                return _original(*args, **kwargs)

            stack.enter_context(mock.patch.object(owner, name, wait))
        yield


def _default_device() -> str:
    """Where a factory without a `device` argument puts its tensor, as a string."""
    return str(torch.get_default_device())


def step_device() -> torch.device:
    """The device a step runs on by default: the current accelerator, else the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator if accelerator is not None else torch.device("cpu")


# megatron-core's device-to-host copy helper, which the CPU shims make a no-op
_MEGATRON_HOST_COPIES = ("megatron.core.transformer.moe.moe_utils",
                         "megatron.core.transformer.moe.token_dispatcher")


@contextlib.contextmanager
def _megatron_host_copies(counter: _Counter):
    """On the stand-in: what megatron's `maybe_move_tensor_to_cpu` returns is host data
    (on a GPU a non-blocking copy; the wait for it is its event's `synchronize`)."""
    with contextlib.ExitStack() as stack:
        for name in _MEGATRON_HOST_COPIES if counter.stand_in else ():
            module = sys.modules.get(name)
            original = getattr(module, "maybe_move_tensor_to_cpu", None)
            if original is None:
                continue

            def to_host(*args, _original=original, **kwargs):
                with counter.quiet():
                    out = _original(*args, **kwargs)
                counter.mark_host(out)
                return out

            stack.enter_context(mock.patch.object(module, "maybe_move_tensor_to_cpu", to_host))
        yield


@contextlib.contextmanager
def _modes(counter: _Counter):
    with _FunctionLevel(counter), _DispatchLevel(counter), _megatron_host_copies(counter):
        yield


@contextlib.contextmanager
def count_host_syncs(device=None) -> Iterator[HostSyncs]:
    """Count the host syncs of the block on `device` (default `step_device()`);
    yields the record, complete when the block exits."""
    record = HostSyncs()
    counter = _Counter(torch.device(device) if device is not None else step_device(), record)
    with _modes(counter), _count_waits(counter):
        yield record


@contextlib.contextmanager
def track_host_tensors() -> Iterator[None]:
    """Without a GPU: remember the host tensors made in the block (see the module
    docstring), so a later `count_host_syncs()` does not count reading them."""
    with _modes(_Counter(torch.device("cpu"), None)):
        yield
