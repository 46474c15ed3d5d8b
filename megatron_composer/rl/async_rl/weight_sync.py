"""Weight sync with delta compression: each step's weights as the XOR of their bits with the last upload.

From one RL step to the next most low-precision weights do not change at all
(in bf16 the update is usually smaller than half a unit in the last place), so
the publisher keeps its previous upload and sends, per tensor, the XOR of the
two bit patterns: zero wherever nothing changed, which a general-purpose
compressor squeezes to almost nothing. The bytes are split into planes first
(every element's first byte, then every second byte, ...), because where a
value did change, only its low mantissa bits do: the sign and exponent
planes stay zero and compress even then. The subscriber XORs the payload into
its copy and gets the new weights bit for bit.

    publisher = WeightPublisher(dtype=torch.bfloat16)      # on the trainer (rank 0 or each rank's shard)
    update = publisher.publish(model_state, version=step)  # full the first time, a delta after
    subscriber = WeightSubscriber()                        # on each inference worker
    state = subscriber.apply(update)                       # {name: tensor}, bit-exact, for Engine.update_weights

A subscriber that lost its copy (a restarted worker) asks for
`publisher.snapshot()`, a full update of the last published weights. A delta
whose base version is not the subscriber's raises ValueError and changes
nothing.

The encoding is ours (a few lines over `torch` bit views and `zlib`, which is
in the standard library): the RL frameworks that do delta sync (slime's
`--update-weight-mode delta`) ship it inside their own transport and do not
offer it as a library.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Mapping, Optional

import torch

# the integer type with each floating type's width: XOR works on bit patterns
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


@dataclasses.dataclass
class TensorPayload:
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes  # zlib of the bytes in planes (`_planes`): of the values (full) or of their XOR with the base (delta)


@dataclasses.dataclass
class WeightUpdate:
    """One published version of the weights."""

    version: int
    base_version: Optional[int]  # None: a full update; else the version this delta applies to
    tensors: dict[str, TensorPayload]
    raw_bytes: int  # what a full, uncompressed upload of these weights takes
    seconds: float  # time to encode

    @property
    def sent_bytes(self) -> int:
        return sum(len(p.data) for p in self.tensors.values())

    @property
    def is_delta(self) -> bool:
        return self.base_version is not None


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous, on CPU) as integers of the same width, sharing its memory."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in _BITS:
        return t.view(_BITS[t.dtype])
    if t.dtype.is_floating_point or t.is_complex():
        raise ValueError(f"weight sync has no bit view for dtype {t.dtype}; cast to one of "
                         f"{', '.join(str(d) for d in _BITS)}")
    return t


def _planes(bits: torch.Tensor) -> bytes:
    """The bytes of `bits` plane by plane: byte 0 of every element, then byte 1, ..."""
    width = bits.element_size()
    flat = bits.reshape(-1)
    if flat.dtype == torch.bool or width == 1:
        return flat.numpy().tobytes()
    return flat.view(torch.uint8).reshape(-1, width).t().contiguous().numpy().tobytes()


def _tensor(data: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    """The inverse of `_planes` for a tensor of `dtype` and `shape`."""
    bits = _BITS.get(dtype, dtype)
    width = torch.empty(0, dtype=bits).element_size()
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if bits == torch.bool or width == 1:
        flat = raw.view(bits)
    else:
        flat = raw.reshape(width, -1).t().contiguous().view(bits)
    return flat.view(dtype).reshape(shape).clone()


class WeightPublisher:
    """Turns weights into `WeightUpdate`s, keeping its last upload as the base of the next delta.

    Args:
        dtype: the dtype weights are sent in (what inference runs; None keeps each tensor's own).
        level: zlib's compression level (1: fastest; deltas are mostly zeros and compress at any level).
    """

    def __init__(self, dtype: Optional[torch.dtype] = torch.bfloat16, *, level: int = 1):
        if not 0 <= level <= 9:
            raise ValueError(f"zlib level {level}; use 0 (store) .. 9 (smallest)")
        self.dtype, self.level = dtype, level
        self._base: dict[str, torch.Tensor] = {}
        self._version: Optional[int] = None

    @property
    def version(self) -> Optional[int]:
        return self._version

    def _cast(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state.items():
            t = t.detach().to("cpu")
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            out[name] = t.contiguous().clone()
        return out

    def publish(self, state: Mapping[str, torch.Tensor], version: int, *, full: bool = False) -> WeightUpdate:
        """The update from the last upload to `state` (full the first time, when asked, or when the
        names, shapes or dtypes changed)."""
        started = time.perf_counter()
        current = self._cast(state)
        same_layout = (self._version is not None and current.keys() == self._base.keys() and all(
            current[n].shape == self._base[n].shape and current[n].dtype == self._base[n].dtype for n in current))
        delta = same_layout and not full
        tensors = {}
        for name, t in current.items():
            bits = bit_view(t)
            if delta:
                bits = torch.bitwise_xor(bits, bit_view(self._base[name]))
            tensors[name] = TensorPayload(t.dtype, tuple(t.shape), zlib.compress(_planes(bits), self.level))
        update = WeightUpdate(int(version), self._version if delta else None, tensors,
                              sum(t.numel() * t.element_size() for t in current.values()),
                              time.perf_counter() - started)
        self._base, self._version = current, int(version)
        return update

    def snapshot(self) -> WeightUpdate:
        """A full update of the last published weights (for a subscriber that starts or restarts)."""
        if self._version is None:
            raise ValueError("nothing was published yet; call publish() first")
        started = time.perf_counter()
        tensors = {n: TensorPayload(t.dtype, tuple(t.shape), zlib.compress(_planes(bit_view(t)), self.level))
                   for n, t in self._base.items()}
        return WeightUpdate(self._version, None, tensors,
                            sum(t.numel() * t.element_size() for t in self._base.values()),
                            time.perf_counter() - started)


class WeightSubscriber:
    """Rebuilds the published weights from a stream of `WeightUpdate`s."""

    def __init__(self):
        self.state: dict[str, torch.Tensor] = {}
        self.version: Optional[int] = None

    def apply(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """The weights of `update.version` (bit-exact); raises ValueError, changing nothing, when a delta's
        base is not this subscriber's version (ask the publisher for a `snapshot()`)."""
        if update.is_delta:
            if update.base_version != self.version:
                raise ValueError(f"a delta from version {update.base_version} cannot apply to version "
                                 f"{self.version}; apply the publisher's snapshot() first")
            missing = sorted(set(update.tensors) ^ set(self.state))
            if missing:
                raise ValueError(f"the delta's tensors differ from this subscriber's: {missing[:4]}; apply a "
                                 f"snapshot() first")
        new = {}
        for name, p in update.tensors.items():
            try:
                data = zlib.decompress(p.data)
            except zlib.error as exc:
                raise ValueError(f"tensor {name} of weights version {update.version} is corrupt: {exc}") from exc
            t = _tensor(data, p.dtype, p.shape)
            if update.is_delta:
                base = self.state[name]
                if base.shape != t.shape or base.dtype != t.dtype:
                    raise ValueError(f"tensor {name}: delta {p.dtype} {tuple(p.shape)} against base {base.dtype} "
                                     f"{tuple(base.shape)}; apply a snapshot() first")
                t = torch.bitwise_xor(bit_view(t), bit_view(base)).view(p.dtype)
            new[name] = t
        self.state, self.version = new, update.version
        return new


def unchanged_fraction(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The fraction of elements whose bit patterns are equal in `a` and `b` (same names and shapes)."""
    same = total = 0
    for name, t in a.items():
        same += int((bit_view(t) == bit_view(b[name])).sum())
        total += t.numel()
    return same / max(total, 1)
