"""Streaming reads of sharded HF safetensors checkpoints, and the shard plan of a write.

`HFCheckpointReader` opens every shard with safetensors' `safe_open` in
"pread" mode (no memory map, so reading a tensor costs that tensor's memory
and nothing stays resident afterwards) and hands out one tensor at a time,
by its published per-expert name, whatever the stored layout:

* per-expert tensors `mlp.experts.E.{gate,up,down}_proj.weight` (the
  published layout, and what transformers 5 `save_pretrained` writes);
* fused 3-D `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj`
  [E, H, I] (transformers 5's in-memory layout), sliced per expert;
* FP8 weights with a `weight_scale_inv` partner, dequantized on read;
* INT4 weights stored as compressed-tensors `weight_packed` / `weight_scale` /
  `weight_shape` (Kimi K2.5's routed experts), dequantized on read by
  `int4.Int4Scheme`;
* a multimodal wrapper's text tensors under a prefix (`language_model.`),
  named without it; the tensors outside it are `other_keys`.

`plan_shards` groups output tensors into `model-XXXXX-of-YYYYY.safetensors`
files of bounded size (`export` writes them).
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch
from safetensors import safe_open

from .config import ConversionError
from .fp8 import dequantize_fp8_blocks
from .int4 import PACKED, SCALE, SHAPE, Int4Scheme

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SCALE = "weight_scale_inv"


def _open(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu", backend="pread")
    except TypeError:  # safetensors without the pread backend
        return safe_open(path, framework="pt", device="cpu")


class HFCheckpointReader:
    """Read-only view of an HF checkpoint directory, one tensor at a time."""

    def __init__(self, path: str, fp8_block=(128, 128), fp8_dtype: torch.dtype = torch.bfloat16,
                 prefix: str = "", int4: Optional["Int4Scheme"] = None):
        """
        Args:
            prefix: where the text model's tensors live (`language_model.` in Kimi K2.5);
                names given to and returned by the reader are relative to it, and
                `other_keys` are the stored tensors outside it (a vision tower).
            int4: the parsed compressed-tensors config of INT4 weights, if any.
        """
        self.path = path
        self.fp8_block = tuple(fp8_block)
        self.fp8_dtype = fp8_dtype
        self.prefix = prefix
        self.int4 = int4
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, SINGLE)):
            with _open(os.path.join(path, SINGLE)) as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise ConversionError(f"{path} has neither {INDEX} nor {SINGLE}")
        for name in sorted(set(self.weight_map.values())):
            if not os.path.exists(os.path.join(path, name)):
                raise ConversionError(f"{INDEX} lists shard {name}, which is missing from {path}")
        self._files: dict[str, object] = {}
        # local (prefix-less) name -> stored name
        self._local = {k[len(prefix):]: k for k in self.weight_map if k.startswith(prefix)}
        self.other_keys = sorted(k for k in self.weight_map if not k.startswith(prefix))
        self.fused_experts = any(k.endswith(".mlp.experts.gate_up_proj") for k in self._local)
        packed = sorted(k for k in self._local if k.endswith("." + PACKED))
        if packed and int4 is None:
            raise ConversionError(f"{prefix}{packed[0]} is INT4 (compressed-tensors) but config.json has no "
                                  "compressed-tensors quantization_config describing it")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for handle in self._files.values():
            handle.__exit__(None, None, None)
        self._files.clear()

    def _handle(self, fname: str):
        if fname not in self._files:
            handle = _open(os.path.join(self.path, fname))
            handle.__enter__()
            self._files[fname] = handle
        return self._files[fname]

    def _file(self, key: str):
        return self._handle(self.weight_map[self._local[key]])

    def stored_tensor(self, key: str) -> torch.Tensor:
        """A stored tensor by its full name, as it is (no dequantization): for `other_keys`."""
        return self._handle(self.weight_map[key]).get_tensor(key)

    def _tensor(self, key: str) -> torch.Tensor:
        return self._file(key).get_tensor(self._local[key])

    def _slice(self, key: str):
        return self._file(key).get_slice(self._local[key])

    @property
    def keys(self) -> set[str]:
        """The stored tensor names under `prefix`, without it."""
        return set(self._local)

    def shard_of(self, name: str) -> str:
        """The file holding what `get(name)` reads first."""
        return self.weight_map[self._local[self._stored(name)[0]]]

    def _int4_module(self, name: str) -> Optional[str]:
        if name.endswith(".weight") and name[: -len("weight")] + PACKED in self._local:
            return name[: -len(".weight")]
        return None

    def _stored(self, name: str) -> tuple[str, Optional[tuple]]:
        """(stored key, index into it) for a published per-expert name."""
        if name in self._local:
            return name, None
        module = self._int4_module(name)
        if module is not None:
            return f"{module}.{PACKED}", ("int4",)
        m = _PER_EXPERT.match(name)
        if m and self.fused_experts:
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            key = prefix + ("down_proj" if proj == "down_proj" else "gate_up_proj")
            if key in self._local:
                return key, (expert, proj)
        raise ConversionError(f"{self.path} lacks tensor {self.prefix}{name}")

    def storage_keys(self, name: str) -> list[str]:
        """The stored tensors `get(name)` reads (weight or fused tensor, FP8 scale, INT4 parts)."""
        key, sub = self._stored(name)
        if sub == ("int4",):
            module = key[: -len(PACKED) - 1]
            return [f"{module}.{part}" for part in (PACKED, SCALE, SHAPE)]
        scale = self._scale_key(key)
        return [key, scale] if scale else [key]

    def has(self, name: str) -> bool:
        try:
            self._stored(name)
            return True
        except ConversionError:
            return False

    def stored_shape(self, key: str) -> tuple:
        """Shape of a stored tensor (e.g. a fused [E, 2I, H] expert tensor)."""
        return self._raw_shape_dtype(key)[0]

    def _raw_shape_dtype(self, key: str) -> tuple[tuple, torch.dtype]:
        sl = self._slice(key)
        return tuple(sl.get_shape()), _DTYPES[sl.get_dtype()]

    def _int4_parts(self, key: str) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
        module = key[: -len(PACKED) - 1]
        for part in (SCALE, SHAPE):
            if f"{module}.{part}" not in self._local:
                raise ConversionError(f"{self.prefix}{key} has no {self.prefix}{module}.{part}; an INT4 "
                                      f"weight is stored as {PACKED}, {SCALE} and {SHAPE}")
        return (module, self._tensor(key), self._tensor(f"{module}.{SCALE}"),
                self._tensor(f"{module}.{SHAPE}"))

    def shape(self, name: str) -> tuple:
        key, sub = self._stored(name)
        if sub == ("int4",):
            return tuple(int(x) for x in self._tensor(key[: -len(PACKED)] + SHAPE).tolist())
        shape, _ = self._raw_shape_dtype(key)
        if sub is None:
            return shape
        expert, proj = sub
        if expert >= shape[0]:
            raise ConversionError(f"{key} has {shape[0]} experts; {name} needs expert {expert}")
        if proj == "down_proj":
            return shape[1:]
        return (shape[1] // 2,) + shape[2:]

    def dtype(self, name: str) -> torch.dtype:
        key, sub = self._stored(name)
        if sub == ("int4",):  # compressed-tensors dequantizes into the scale's dtype
            return self._raw_shape_dtype(key[: -len(PACKED)] + SCALE)[1]
        _, dtype = self._raw_shape_dtype(key)
        if self._scale_key(key):
            return self.fp8_dtype
        return dtype

    def _scale_key(self, key: str) -> Optional[str]:
        if key.endswith(".weight"):
            scale = key[: -len("weight")] + _SCALE
            if scale in self._local:
                return scale
        return None

    def get(self, name: str) -> torch.Tensor:
        """The tensor published as `name` (dequantized when stored as FP8 or INT4)."""
        key, sub = self._stored(name)
        if sub == ("int4",):
            module, packed, scale, shape = self._int4_parts(key)
            return self.int4.dequantize(self.prefix + module, packed, scale, shape).contiguous()
        if sub is None:
            tensor = self._tensor(key)
        else:
            expert, proj = sub
            sl = self._slice(key)
            rows = sl.get_shape()[1]
            if proj == "gate_proj":
                tensor = sl[expert:expert + 1, : rows // 2][0]
            elif proj == "up_proj":
                tensor = sl[expert:expert + 1, rows // 2:][0]
            else:
                tensor = sl[expert:expert + 1][0]
        scale_key = self._scale_key(key)
        if scale_key:
            if tensor.dtype != torch.float8_e4m3fn:
                raise ConversionError(f"{key} has a {_SCALE} but dtype {tensor.dtype}; expected float8_e4m3fn")
            scale = self._tensor(scale_key)
            tensor = dequantize_fp8_blocks(tensor, scale, self.fp8_block, self.fp8_dtype, name=self.prefix + key)
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConversionError(f"{self.prefix}{key} is {tensor.dtype} but the checkpoint has no "
                                  f"{self.prefix}{key[:-6]}{_SCALE}")
        return tensor.contiguous()

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of an unquantized 2-D tensor (for chunked comparisons)."""
        key, sub = self._stored(name)
        if sub is not None or self._scale_key(key):
            return self.get(name)[start:end]
        return self._slice(key)[start:end]


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most `max_shard_bytes` (a bigger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = []
    current, size = [], 0
    for name, nbytes in sizes:
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards
