"""The weight-update format: each step's weights as the XOR of their bits with the last upload.

One format, three transports: a `WeightUpdate` is applied in process by a
`WeightSubscriber` (the async RL inference workers, our HTTP server), travels
through Ray's object store as it is, and over HTTP as `encode_update`'s bytes
(a safetensors file: one uint8 tensor per payload, the rest in its metadata;
`POST /v1/weights` with `Content-Type: application/octet-stream`).

From one RL step to the next most low-precision weights do not change at all
(in bf16 the update is usually smaller than half a unit in the last place), so
the publisher keeps its previous upload and sends, per tensor, the XOR of the
two bit patterns: zero wherever nothing changed, which a general-purpose
compressor squeezes to almost nothing. The bytes are split into planes first
(every element's first byte, then every second byte, ...), because where a
value did change, only its low mantissa bits do: the sign and exponent
planes stay zero and compress even then. The subscriber XORs the payload into
its copy and gets the new weights bit for bit.

    publisher = WeightPublisher(dtype=torch.bfloat16)      # on the trainer's rank 0 (the whole weights)
    update = publisher.publish(model_state, version=step)  # full the first time, a delta after
    subscriber = WeightSubscriber()                        # on each inference worker
    state = subscriber.apply(update)                       # {name: tensor}, bit-exact, for Engine.update_weights

`BackgroundPublisher` runs the same encoding on a thread of its own: the
training step waits only for the copy of the weights, and the XOR and zlib of
one version overlap the next step (torch's kernels and zlib release the GIL).

A subscriber that lost its copy (a restarted worker) asks for
`publisher.snapshot()`, a full update of the last published weights. A delta
whose base version is not the subscriber's raises `StaleBaseError` (a
ValueError) and changes nothing; so does any malformed update (`decode_update`
and `WeightSubscriber.rebuild` check names, dtypes, shapes and sizes before
decompressing more than a tensor's own size).

The encoding is ours (a few lines over `torch` bit views and `zlib`, which is
in the standard library): the RL frameworks that do delta sync (slime's
`--update-weight-mode delta`) ship it inside their own transport and do not
offer it as a library.
"""
from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
import time
import zlib
from typing import Mapping, Optional

import torch

# the integer type with each floating type's width: XOR works on bit patterns
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}
# the dtypes an update may carry, by the name the wire format uses
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}
FORMAT = "megatron-composer-weight-update-1"  # safetensors metadata "format" of `encode_update`
CONTENT_TYPE = "application/octet-stream"


class StaleBaseError(ValueError):
    """A delta whose base version is not the subscriber's: send a full snapshot instead."""


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


_ZLIB_MAX_RATIO = 1032  # deflate never expands a byte of input into more than ~1032 bytes


def _decompress(name: str, p: TensorPayload, version: int) -> bytes:
    """The plane bytes of payload `p`: exactly its tensor's size, or ValueError; never inflates
    more than that size (a payload cannot claim more memory than its shape says)."""
    size = math.prod(p.shape) * torch.empty(0, dtype=p.dtype).element_size()
    mismatch = (f"tensor {name} of weights version {version} is corrupt: its payload does not hold "
                f"{p.dtype} {tuple(p.shape)} ({size} bytes); it is truncated or from another tensor")
    if size > _ZLIB_MAX_RATIO * len(p.data) + 64:
        raise ValueError(mismatch)
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(p.data, size + 1)  # + 1: a longer stream shows itself
    except zlib.error as exc:
        raise ValueError(f"{mismatch} ({exc})") from None
    if len(data) != size or not inflate.eof or inflate.unused_data:
        raise ValueError(mismatch)
    return data


def _tensor(data: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    """The inverse of `_planes` for a tensor of `dtype` and `shape`."""
    if not data:
        return torch.empty(shape, dtype=dtype)  # no element: no plane to view
    bits = _BITS.get(dtype, dtype)
    width = torch.empty(0, dtype=bits).element_size()
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
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

    def copy(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` in host memory and the wire dtype, copied: the caller may change `state` afterwards."""
        return {name: self.copy_tensor(source) for name, source in state.items()}

    def copy_tensor(self, source: torch.Tensor) -> torch.Tensor:
        """One tensor as `copy` copies it: on the host, in the wire dtype, not sharing `source`'s memory."""
        t = source.detach().to("cpu")  # moved first, then cast on the host: the same bits on every device
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        if t.data_ptr() == source.data_ptr():  # neither moved nor cast: still the caller's memory
            t = t.clone()
        return t.contiguous()

    def publish(self, state: Mapping[str, torch.Tensor], version: int, *, full: bool = False) -> WeightUpdate:
        """The update from the last upload to `state` (full the first time, when asked, or when the
        names, shapes or dtypes changed)."""
        started = time.perf_counter()
        return self.encode(self.copy(state), version, full=full, started=started)

    def encode(self, current: dict[str, torch.Tensor], version: int, *, full: bool = False,
               started: Optional[float] = None) -> WeightUpdate:
        """`publish` of weights that `copy` returned (this publisher keeps them as the next base)."""
        started = time.perf_counter() if started is None else started
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


class BackgroundPublisher:
    """A `WeightPublisher` that encodes on a thread of its own, off the training step's critical path.

    `submit` copies the weights (`WeightPublisher.copy`: the only part the caller waits for, after
    which the weights may change) and queues the copy; the thread encodes it into the update that
    `WeightPublisher.publish` returns for the same state, bytes and versions alike, while the next
    step runs; `result(version)` waits for that update. The queue holds one copy: a caller that
    submits faster than the thread encodes waits in `submit`, so at most two copies of the weights
    (one queued, one being encoded) exist besides the publisher's base.

        publisher = BackgroundPublisher(WeightPublisher(torch.bfloat16))
        publisher.submit(model_state, version=step)   # returns once the weights are copied
        ...                                           # the next step changes the weights meanwhile
        update = publisher.result(step)               # the WeightUpdate, as publish() makes it
    """

    KEPT = 2  # encoded updates kept for `result` (the newest ones); older versions are superseded

    def __init__(self, publisher: WeightPublisher):
        self.publisher = publisher
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._done = threading.Condition()  # guards the bookkeeping below; signals each encoded version
        self._encoding = threading.Lock()  # held while the publisher's base may move (encode, snapshot)
        self._results: dict[int, object] = {}  # version -> WeightUpdate, or the exception encoding raised
        self._submitted: Optional[int] = None  # the newest version handed to `submit`
        self._encoded: Optional[int] = None  # the newest version the thread has finished with
        self.last: Optional[WeightUpdate] = None  # the newest update encoded (for its sizes and time)
        self._thread = threading.Thread(target=self._encode_loop, name="weight-publisher", daemon=True)
        self._thread.start()

    @property
    def version(self) -> Optional[int]:
        """The newest version submitted (encoded or not yet)."""
        return self._submitted

    def submit(self, state: Mapping[str, torch.Tensor], version: int, *, full: bool = False) -> None:
        """Copy `state` and queue it for encoding as `version`; waits while an earlier copy is queued."""
        self.enqueue(self.publisher.copy(state), version, full=full)

    def enqueue(self, current: dict[str, torch.Tensor], version: int, *, full: bool = False) -> None:
        """`submit` of weights already copied (`WeightPublisher.copy`, or its `copy_tensor` per tensor, as
        the async trainer's gather does); this publisher owns them from here on."""
        if not self._thread.is_alive():
            raise RuntimeError("this publisher is closed; make a new BackgroundPublisher")
        self._queue.put((current, int(version), full))
        self._submitted = int(version)

    def result(self, version: int, timeout: Optional[float] = None) -> WeightUpdate:
        """The update of `version` once encoded (raises what encoding raised; ValueError for a version
        that was never submitted or already superseded by `KEPT` newer ones)."""
        version = int(version)
        if self._submitted is None or version > self._submitted:
            raise ValueError(f"weights version {version} was not submitted (newest: {self._submitted})")
        with self._done:
            if not self._done.wait_for(lambda: self._encoded is not None and self._encoded >= version, timeout):
                raise TimeoutError(f"weights version {version} was not encoded within {timeout} s")
            if version not in self._results:
                raise ValueError(f"weights version {version} was superseded by version {self._encoded}; "
                                 "ask for a snapshot()")
            out = self._results[version]
        if isinstance(out, BaseException):
            raise out
        return out

    def snapshot(self, timeout: Optional[float] = None) -> WeightUpdate:
        """A full update of the newest submitted weights, once they are encoded."""
        if self._submitted is None:
            raise ValueError("nothing was published yet; call submit() first")
        target = self._submitted
        with self._done:
            if not self._done.wait_for(lambda: self._encoded is not None and self._encoded >= target, timeout):
                raise TimeoutError(f"weights version {target} was not encoded within {timeout} s")
        with self._encoding:
            return self.publisher.snapshot()

    def close(self) -> None:
        """Finish what is queued and stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _encode_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            current, version, full = job
            with self._encoding:
                try:
                    out = self.publisher.encode(current, version, full=full)
                except Exception as exc:  # noqa: BLE001 - handed to whoever asks for this version
                    out = exc
            with self._done:
                if isinstance(out, WeightUpdate):
                    self.last = out
                self._results[version] = out
                for old in sorted(self._results)[:-self.KEPT]:
                    del self._results[old]
                self._encoded = version
                self._done.notify_all()


class WeightSubscriber:
    """Rebuilds the published weights from a stream of `WeightUpdate`s."""

    def __init__(self):
        self.state: dict[str, torch.Tensor] = {}
        self.version: Optional[int] = None

    def apply(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """The weights of `update.version` (bit-exact), now this subscriber's; raises ValueError, changing
        nothing, for a malformed update, and StaleBaseError when a delta's base is not this subscriber's
        version (ask the publisher for a `snapshot()`)."""
        new = self.rebuild(update)
        self.commit(update, new)
        return new

    def rebuild(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """The weights of `update.version`, without making them this subscriber's (`commit` does):
        for a receiver that checks them against its model first."""
        if update.is_delta:
            if update.base_version != self.version:
                raise StaleBaseError(f"a delta from version {update.base_version} cannot apply to version "
                                     f"{self.version}; apply the publisher's snapshot() first")
            missing = sorted(set(update.tensors) ^ set(self.state))
            if missing:
                raise StaleBaseError(f"the delta's tensors differ from this subscriber's: {missing[:4]}; apply a "
                                     f"snapshot() first")
        new = {}
        for name, p in update.tensors.items():
            if p.dtype not in DTYPES.values():
                raise ValueError(f"tensor {name!r} has dtype {p.dtype}; an update carries one of {sorted(DTYPES)}")
            if update.is_delta:
                base = self.state[name]
                if base.shape != tuple(p.shape) or base.dtype != p.dtype:
                    raise StaleBaseError(f"tensor {name}: delta {p.dtype} {tuple(p.shape)} against base "
                                         f"{base.dtype} {tuple(base.shape)}; apply a snapshot() first")
            t = _tensor(_decompress(name, p, update.version), p.dtype, p.shape)
            if update.is_delta:
                t = torch.bitwise_xor(bit_view(t), bit_view(self.state[name])).view(p.dtype)
            new[name] = t
        return new

    def commit(self, update: WeightUpdate, state: dict[str, torch.Tensor]) -> None:
        """Make `state` (what `rebuild(update)` returned) this subscriber's weights of `update.version`."""
        self.state, self.version = state, update.version

    def reset(self) -> None:
        """Forget the weights (the receiver's changed another way): the next update must be full."""
        self.state, self.version = {}, None


# ---------------------------------------------------------------- bytes (HTTP)
def encode_update(update: WeightUpdate) -> bytes:
    """`update` as one safetensors file: tensor NAME is its payload (uint8), the metadata holds
    the format, the versions and each tensor's dtype and shape (`decode_update` reads it)."""
    from safetensors.torch import save

    tensors = {name: torch.frombuffer(bytearray(p.data), dtype=torch.uint8) if p.data
               else torch.empty(0, dtype=torch.uint8) for name, p in update.tensors.items()}
    header = {"version": update.version, "base_version": update.base_version, "raw_bytes": update.raw_bytes,
              "tensors": {name: [str(p.dtype).removeprefix("torch."), list(p.shape)]
                          for name, p in update.tensors.items()}}
    return save(tensors, metadata={"format": FORMAT, "update": json.dumps(header)})


def _int(value, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}; got {value!r:.40}")
    return value


def decode_update(data: bytes) -> WeightUpdate:
    """The `WeightUpdate` `encode_update` wrote; ValueError naming what is wrong for anything else
    (not safetensors, truncated, another format, unknown dtypes, payloads that do not match)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
        metadata = _metadata(data)  # load() has checked the framing
    except (SafetensorError, ValueError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"the body is not a weight update (safetensors bytes of `encode_update`): {exc}") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"the safetensors metadata names format {metadata.get('format')!r}, not {FORMAT!r}; "
                         "send the bytes of inference.weight_sync.encode_update")
    try:
        header = json.loads(metadata.get("update", ""))
        specs = header["tensors"]
        version = _int(header["version"], "version")
        base = header["base_version"]
        base = None if base is None else _int(base, "base_version")
        raw_bytes = _int(header.get("raw_bytes", 0), "raw_bytes")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the weight update's metadata is malformed ({type(exc).__name__}: {exc})") from None
    listed = sorted(specs) if isinstance(specs, dict) else []
    if not listed or listed != sorted(tensors):
        raise ValueError(f"the weight update's metadata lists tensors {listed[:4]} but the file holds "
                         f"{sorted(tensors)[:4]}; an update has at least one tensor, each listed once")
    payloads = {}
    for name, spec in specs.items():
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES and isinstance(spec[1], list)):
            raise ValueError(f"tensor {name!r}: [dtype, shape] expected with a dtype of {sorted(DTYPES)}; "
                             f"got {spec!r:.80}")
        shape = tuple(_int(d, f"tensor {name!r}'s shape") for d in spec[1])
        t = tensors[name]
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise ValueError(f"tensor {name!r}: its payload is {t.dtype} {tuple(t.shape)}, not 1-d uint8 bytes")
        payloads[name] = TensorPayload(DTYPES[spec[0]], shape, t.numpy().tobytes())
    return WeightUpdate(version, base, payloads, raw_bytes, 0.0)


def _metadata(data: bytes) -> dict:
    """The `__metadata__` of a safetensors file (its 8-byte header length, then the JSON header)."""
    length = int.from_bytes(bytes(data[:8]), "little")
    header = json.loads(bytes(data[8:8 + length]))
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("the safetensors __metadata__ is not an object")
    return metadata


def unchanged_fraction(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The fraction of elements whose bit patterns are equal in `a` and `b` (same names and shapes)."""
    same = total = 0
    for name, t in a.items():
        same += int((bit_view(t) == bit_view(b[name])).sum())
        total += t.numel()
    return same / max(total, 1)
