"""Streaming reads and bounded writes of sharded HF safetensors checkpoints.

`HFCheckpointReader` opens every shard with safetensors' `safe_open` in
"pread" mode (no memory map, so reading a tensor costs that tensor's memory
and nothing stays resident afterwards) and hands out one tensor at a time,
by its published per-expert name, whatever the stored layout:

* per-expert tensors `mlp.experts.E.{gate,up,down}_proj.weight` (the
  published layout, and what transformers 5 `save_pretrained` writes);
* fused 3-D `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj`
  [E, H, I] (transformers 5's in-memory layout), sliced per expert;
* FP8 weights with a `weight_scale_inv` partner, dequantized on read.

`write_shards` writes tensors produced group by group into
`model-XXXXX-of-YYYYY.safetensors` files of bounded size plus
`model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConversionError
from .fp8 import dequantize_fp8_blocks

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

    def __init__(self, path: str, fp8_block=(128, 128), fp8_dtype: torch.dtype = torch.bfloat16):
        self.path = path
        self.fp8_block = tuple(fp8_block)
        self.fp8_dtype = fp8_dtype
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
        self.fused_experts = any(k.endswith(".mlp.experts.gate_up_proj") for k in self.weight_map)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for handle in self._files.values():
            handle.__exit__(None, None, None)
        self._files.clear()

    def _file(self, key: str):
        name = self.weight_map[key]
        if name not in self._files:
            handle = _open(os.path.join(self.path, name))
            handle.__enter__()
            self._files[name] = handle
        return self._files[name]

    @property
    def keys(self) -> set[str]:
        return set(self.weight_map)

    def _stored(self, name: str) -> tuple[str, Optional[tuple]]:
        """(stored key, index into it) for a published per-expert name."""
        if name in self.weight_map:
            return name, None
        m = _PER_EXPERT.match(name)
        if m and self.fused_experts:
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            key = prefix + ("down_proj" if proj == "down_proj" else "gate_up_proj")
            if key in self.weight_map:
                return key, (expert, proj)
        raise ConversionError(f"{self.path} lacks tensor {name}")

    def storage_keys(self, name: str) -> list[str]:
        """The stored tensors `get(name)` reads (weight or fused tensor, FP8 scale)."""
        key, _ = self._stored(name)
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
        sl = self._file(key).get_slice(key)
        return tuple(sl.get_shape()), _DTYPES[sl.get_dtype()]

    def shape(self, name: str) -> tuple:
        key, sub = self._stored(name)
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
        key, _ = self._stored(name)
        _, dtype = self._raw_shape_dtype(key)
        if self._scale_key(key):
            return self.fp8_dtype
        return dtype

    def _scale_key(self, key: str) -> Optional[str]:
        if key.endswith(".weight"):
            scale = key[: -len("weight")] + _SCALE
            if scale in self.weight_map:
                return scale
        return None

    def get(self, name: str) -> torch.Tensor:
        """The tensor published as `name` (dequantized when stored as FP8)."""
        key, sub = self._stored(name)
        handle = self._file(key)
        if sub is None:
            tensor = handle.get_tensor(key)
        else:
            expert, proj = sub
            sl = handle.get_slice(key)
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
            scale = self._file(scale_key).get_tensor(scale_key)
            tensor = dequantize_fp8_blocks(tensor, scale, self.fp8_block, self.fp8_dtype, name=key)
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConversionError(f"{key} is {tensor.dtype} but the checkpoint has no {key[:-6]}{_SCALE}")
        return tensor.contiguous()

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of an unquantized 2-D tensor (for chunked comparisons)."""
        key, sub = self._stored(name)
        if sub is not None or self._scale_key(key):
            return self.get(name)[start:end]
        return self._file(key).get_slice(key)[start:end]


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


def write_shards(
    out_dir: str,
    shards: list[list[str]],
    produce: Callable[[list[str]], Iterable[tuple[str, torch.Tensor]]],
    on_bytes: Optional[Callable[[int], None]] = None,
) -> dict[str, str]:
    """Write each shard's tensors (from `produce(names)`) and the index; return the weight map.

    Only one shard's tensors are alive at a time.
    """
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        tensors = dict(produce(names))
        missing = set(names) - set(tensors)
        if missing:
            raise ConversionError(f"internal: shard {i} produced no {sorted(missing)[:3]}")
        fname = shard_name(i, len(shards))
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        weight_map.update({name: fname for name in names})
        del tensors
        if on_bytes:
            on_bytes(nbytes)
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return weight_map
