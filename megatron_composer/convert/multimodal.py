"""Kimi K2.5's multimodal wrapper: the text backbone in, the vision parts kept aside and put back.

The published Kimi K2.5 (`KimiK25ForConditionalGeneration`, model_type
`kimi_k25`) is a DeepSeek-V3-style text model inside a wrapper:

    config.json   {"model_type": "kimi_k25", "text_config": {<DeepSeek-V3 config>}, "vision_config": ...}
    tensors       language_model.model.layers.* , language_model.lm_head.weight   the text backbone
                  vision_tower.*                                                  MoonViT
                  mm_projector.*                                                  vision -> text projector

`SourceConfig` splits such a config (or a plain DeepSeek-V3 / Kimi-K2 one)
into the text config the converter maps, the wrapper that export writes back
around it, the tensor prefix of the text model, and the quantization of its
weights (block FP8, compressed-tensors INT4, or none; anything else is
refused by name).

This recipe trains the text backbone only, so the vision tower and projector
go into `ROOT/hf_multimodal/` unchanged: safetensors files plus
`manifest.json` listing every tensor's name, dtype, shape, source shard and
the sha256 of its bytes. Export verifies each tensor against the manifest
and writes it back, so the served model's vision parts are byte-identical to
the published ones.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from safetensors.torch import save_file

from .config import ConversionError
from .int4 import METHOD as INT4_METHOD, Int4Scheme, parse_int4_config

TEXT_PREFIX = "language_model."
MULTIMODAL_DIR = "hf_multimodal"
MANIFEST = "manifest.json"
FP8_METHOD = "fp8"


@dataclass
class SourceConfig:
    """What config.json says about a checkpoint's layout.

    full: the config as published; text: the DeepSeek-V3 config of the text
    model (`full["text_config"]` or `full` itself); wrapper: True for a
    multimodal wrapper; prefix: where the text tensors live; quant: the
    `quantization_config` (from text_config, else the top level) or None;
    quant_location: "text_config" or "config" (where export writes it back).
    """

    full: dict
    text: dict
    wrapper: bool
    prefix: str
    quant: Optional[dict]
    quant_location: Optional[str]
    int4: Optional[Int4Scheme] = field(default=None, repr=False)

    @property
    def quant_method(self) -> Optional[str]:
        return self.quant.get("quant_method") if self.quant else None

    def fp8_block(self) -> tuple[int, int]:
        if self.quant_method != FP8_METHOD:
            return (128, 128)
        return tuple(self.quant.get("weight_block_size") or (128, 128))


def read_source_config(full: dict) -> SourceConfig:
    """SourceConfig of a parsed config.json; ConversionError for a quantization we do not read."""
    wrapper = "text_config" in full
    if wrapper and not isinstance(full["text_config"], dict):
        raise ConversionError(f"config.json text_config is a {type(full['text_config']).__name__}, "
                              "not an object holding the language model's config")
    text = dict(full["text_config"]) if wrapper else full
    quant, location = None, None
    if text.get("quantization_config"):
        quant, location = text["quantization_config"], "text_config" if wrapper else "config"
    elif wrapper and full.get("quantization_config"):
        quant, location = full["quantization_config"], "config"
    source = SourceConfig(full, text, wrapper, TEXT_PREFIX if wrapper else "", quant, location)
    method = source.quant_method
    if quant is None:
        return source
    if method == FP8_METHOD:
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ConversionError(f"quantization_config.quant_method='fp8' fmt={quant.get('fmt')!r}: only "
                                  "DeepSeek's block-scaled e4m3 weights are dequantized on import")
        return source
    if method == INT4_METHOD:
        source.int4 = parse_int4_config(quant)
        return source
    raise ConversionError(
        f"quantization_config.quant_method={method!r} is not read by this converter: it dequantizes "
        f"DeepSeek's block FP8 ('{FP8_METHOD}') and Kimi's INT4 ('{INT4_METHOD}', pack-quantized). "
        "Dequantize the checkpoint to bf16 with the tool that made it (or use the publisher's bf16 or "
        "original release) and convert that")


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def keep_aside(reader, names: list[str], out_root: str, max_file_bytes: int, on_bytes=None) -> dict:
    """Copy the stored tensors `names` (full names) into OUT_ROOT/hf_multimodal/ unchanged, files
    of at most `max_file_bytes`, and write the manifest; returns it."""
    out_dir = os.path.join(out_root, MULTIMODAL_DIR)
    os.makedirs(out_dir, exist_ok=True)
    entries: dict[str, dict] = {}
    batch: dict[str, torch.Tensor] = {}
    size, index = 0, 0

    def flush():
        nonlocal batch, size, index
        if batch:
            fname = f"tensors-{index + 1:05d}.safetensors"
            save_file(batch, os.path.join(out_dir, fname), metadata={"format": "pt"})
            for key in batch:
                entries[key]["file"] = fname
            index += 1
            batch, size = {}, 0

    for key in names:
        tensor = reader.stored_tensor(key)
        nbytes = tensor.numel() * tensor.element_size()
        if batch and size + nbytes > max_file_bytes:
            flush()
        entries[key] = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape),
                        "sha256": _sha256(tensor), "source_file": reader.weight_map[key]}
        batch[key] = tensor
        size += nbytes
        if on_bytes:
            on_bytes(nbytes)
    flush()
    manifest = {"tensors": entries}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def read_manifest(root: str) -> Optional[dict]:
    """The kept-aside tensors' manifest of a checkpoint root, or None when it has none."""
    path = os.path.join(root, MULTIMODAL_DIR, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def restore_tensor(root: str, manifest: dict, key: str) -> torch.Tensor:
    """A kept-aside tensor, checked against the manifest (dtype, shape, sha256)."""
    from safetensors import safe_open

    entry = manifest["tensors"][key]
    path = os.path.join(root, MULTIMODAL_DIR, entry["file"])
    if not os.path.exists(path):
        raise ConversionError(f"{path} is missing; the checkpoint's {MULTIMODAL_DIR}/ is incomplete: copy it "
                              "again from the converted checkpoint, or re-convert the Hugging Face source")
    with safe_open(path, framework="pt") as f:
        tensor = f.get_tensor(key)
    got = (_dtype_name(tensor.dtype), list(tensor.shape), _sha256(tensor))
    want = (entry["dtype"], entry["shape"], entry["sha256"])
    if got != want:
        raise ConversionError(f"{key} in {path} is {got[0]} {got[1]} sha256 {got[2][:12]}..., the manifest says "
                              f"{want[0]} {want[1]} sha256 {want[2][:12]}...: the file was changed; restore it "
                              "from the Hugging Face source")
    return tensor


def tensor_nbytes(entry: dict) -> int:
    numel = 1
    for d in entry["shape"]:
        numel *= d
    return numel * getattr(torch, entry["dtype"]).itemsize


def export_config(text: dict, conversion: dict, int4_config: Optional[dict]) -> dict:
    """The config.json of an export: `text` (the text model's config) inside the imported wrapper,
    if there was one, with the quantization_config of the exported weights (or none)."""
    wrapper = conversion.get("hf_wrapper_config")
    text = dict(text)
    location = conversion.get("quantization_location") or ("text_config" if wrapper else "config")
    if not wrapper:
        if int4_config:
            text["quantization_config"] = int4_config
        return text
    out = {k: v for k, v in wrapper.items() if k != "quantization_config"}
    if int4_config:
        if location == "text_config":
            text["quantization_config"] = int4_config
        else:
            out["quantization_config"] = int4_config
    out["text_config"] = text
    return out
