"""INT4 routed experts as Kimi K2-Thinking / K2.5 publish them: compressed-tensors `pack-quantized`.

The published checkpoints quantize every routed expert's `gate_proj`,
`up_proj` and `down_proj` to symmetric int4 with one scale per group of 32
input columns; attention, shared experts, the dense layers, the router,
embeddings and head stay bf16. A quantized linear `X` is stored as

    X.weight_packed   int32 [out, in / 8]   eight int4 values per word
    X.weight_scale    bf16  [out, in / 32]  the multiplier of each group
    X.weight_shape    int   [2]             (out, in)

and `quantization_config` (quant_method "compressed-tensors", format
"pack-quantized") says which modules are quantized (`config_groups`:
targets, `ignore`) and how (`weights`: num_bits, group_size, symmetric).

The `compressed-tensors` library is the reference for both directions, not
an unpacking of ours: import calls its `PackedQuantizationCompressor.
decompress` (value = int4 * scale, formed in the scale's dtype, which is what
vLLM and SGLang compute), and `--export-int4` chooses each group's scale by
the library's own quantize-dequantize (its min-max observer's scale and the
scales that put the group's largest value on the grid, `Int4Scheme.quantize`)
and packs with its `compress`. An unchanged import comes back bit for bit;
weights a run moved off the grid are rounded (the README gives the error).

The library is imported on first use, so a checkpoint without INT4 weights
never needs it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

from .config import ConversionError

PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
INT4_SUFFIXES = ("." + PACKED, "." + SCALE, "." + SHAPE)
FORMAT = "pack-quantized"
METHOD = "compressed-tensors"
_INSTALL = ("`make setup` installs it; or pip install --no-deps 'compressed-tensors>=0.20' loguru psutil "
            "(--no-deps keeps your torch)")

# What `--export-int4` writes when the imported checkpoint had no compressed-tensors config
# (a bf16 or FP8 source): Kimi K2.5's scheme, routed experts only. `ignore` lists every other
# linear of the text backbone and the vision parts, with or without the `language_model.` prefix.
DEFAULT_CONFIG = {
    "quant_method": METHOD,
    "format": FORMAT,
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False, "actorder": None, "block_structure": None,
                        "observer": "minmax", "observer_kwargs": {}},
        }
    },
    "ignore": ["re:.*lm_head$", "re:.*self_attn\\..*", "re:.*shared_experts\\..*",
               "re:.*\\.mlp\\.(gate|up|gate_up|down)_proj$", "re:.*\\.mlp\\.gate$", "re:.*eh_proj$",
               "re:.*shared_head\\..*", "re:vision_tower\\..*", "re:mm_projector\\..*"],
}


def _library():
    try:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.quantization.utils.helpers import calculate_qparams
        from compressed_tensors.utils.match import match_name
    except ImportError as exc:
        raise ConversionError(f"this checkpoint's routed experts are INT4 (compressed-tensors "
                              f"pack-quantized); reading or writing them needs the library: {_INSTALL} "
                              f"({exc})") from None
    return BaseCompressor, QuantizationConfig, calculate_qparams, match_name


def module_of(key: str) -> Optional[str]:
    """`X` for a stored `X.weight_packed` / `.weight_scale` / `.weight_shape`, else None."""
    for suffix in INT4_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return None


@dataclass
class Int4Scheme:
    """A parsed `quantization_config` of method compressed-tensors, format pack-quantized."""

    raw: dict
    config: object  # compressed_tensors QuantizationConfig

    @property
    def group_size(self) -> int:
        return int(next(iter(self.config.config_groups.values())).weights.group_size)

    def scheme_for(self, module: str):
        """The config group quantizing `module` (its full stored name); ConversionError if none does."""
        _, _, _, match_name = _library()
        ignored = [p for p in self.config.ignore if match_name(module, p)]
        if ignored:
            raise ConversionError(f"{module}.{PACKED} is stored, but quantization_config.ignore lists it "
                                  f"({ignored[0]!r}); the config and the weights disagree")
        for name, group in self.config.config_groups.items():
            if "Linear" in group.targets or any(match_name(module, t) for t in group.targets):
                return group
        raise ConversionError(f"{module}.{PACKED} is stored, but no quantization_config.config_groups "
                              "entry targets it")

    def dequantize(self, module: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The weight `module` stores in INT4, through compressed-tensors' own decompression."""
        BaseCompressor = _library()[0]
        scheme = self.scheme_for(module)
        compressor = BaseCompressor.get_value_from_registry(FORMAT)
        try:
            weight = compressor.decompress({PACKED: packed, SCALE: scale, SHAPE: shape}, scheme)["weight"]
        except (RuntimeError, ValueError, IndexError) as exc:
            raise ConversionError(f"{module}: compressed-tensors cannot decompress {PACKED} "
                                  f"{tuple(packed.shape)} with {SCALE} {tuple(scale.shape)} and "
                                  f"{SHAPE} {shape.tolist()}: {exc}") from None
        return weight if dtype is None else weight.to(dtype)

    def quantize(self, module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """{weight_packed, weight_scale, weight_shape} of `weight` [out, in] for `module`.

        The scale of each group is the candidate whose round trip through
        compressed-tensors' own quantize-dequantize (`fake_quantize`) is
        closest to the group: its min-max observer's (`calculate_qparams`:
        max |w| / 7.5), max |w| / 7 and max |w| / 8 (the group's largest value
        on code +7 or -8), and the neighbouring values of those two in the
        scale's dtype. Weights still on an INT4 grid (an untrained import of
        Kimi's QAT checkpoint) get their published scales and codes back
        exactly, which min-max alone never does (it shrinks every group by
        7 / 7.5); weights off the grid get the smallest error of the
        candidates. Values are then quantized and packed by compressed-
        tensors' `compress`. Scales are in `weight`'s dtype, as the library's
        observer makes them.
        """
        BaseCompressor, _, calculate_qparams, _ = _library()
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize

        scheme = self.scheme_for(module)
        args = scheme.weights
        group = int(args.group_size)
        rows, cols = weight.shape
        if cols % group:
            raise ConversionError(f"{module}: {cols} input columns are not a multiple of the INT4 group "
                                  f"size {group}; export it without --export-int4")
        groups = weight.unflatten(-1, (cols // group, group))
        minmax, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        top = groups.float().abs().amax(-1)
        candidates = [minmax]
        for largest in (2 ** (args.num_bits - 1) - 1, 2 ** (args.num_bits - 1)):
            candidates += _with_neighbours((top / largest).to(minmax.dtype))
        errors = []
        for scale in candidates:
            valid = torch.isfinite(scale) & (scale > 0)
            scale = torch.where(valid, scale, minmax)
            fq = fake_quantize(weight, scale, zero, args)
            error = (fq.float() - weight.float()).pow(2).unflatten(-1, (cols // group, group)).sum(-1)
            errors.append(torch.where(valid, error, torch.inf))
        best = torch.stack(errors).argmin(0)
        scale = torch.stack([torch.where(torch.isfinite(c) & (c > 0), c, minmax) for c in candidates])
        scale = scale.gather(0, best[None])[0].contiguous()
        state = {"weight": weight, SCALE: scale, "weight_zero_point": zero}
        out = BaseCompressor.get_value_from_registry(FORMAT).compress(state, scheme)
        return {PACKED: out[PACKED], SCALE: out[SCALE], SHAPE: out[SHAPE]}


def _with_neighbours(scale: torch.Tensor) -> list[torch.Tensor]:
    """`scale` and the next representable values below and above it in its dtype."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[scale.element_size()]
    raw = scale.view(bits)
    return [scale, (raw - 1).view(scale.dtype), (raw + 1).view(scale.dtype)]


def parse_int4_config(quant: dict) -> Int4Scheme:
    """Int4Scheme for a compressed-tensors `quantization_config`; ConversionError naming what is
    not Kimi's symmetric-int pack-quantized scheme."""
    _, QuantizationConfig, _, _ = _library()
    fmt = quant.get("format")
    if fmt != FORMAT:
        raise ConversionError(f"quantization_config.format={fmt!r}: of compressed-tensors checkpoints "
                              f"only {FORMAT!r} (Kimi K2.5's INT4 routed experts) is dequantized on import; "
                              "dequantize it first with compressed-tensors' CompressedTensorsDequantizer")
    try:
        config = QuantizationConfig.model_validate(copy.deepcopy(quant))
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError
        raise ConversionError(f"quantization_config is not a valid compressed-tensors config: {exc}") from None
    if not config.config_groups:
        raise ConversionError("quantization_config.config_groups is empty; nothing says how weights are packed")
    for name, group in config.config_groups.items():
        w = group.weights
        where = f"quantization_config.config_groups.{name}.weights"
        if w is None or w.type != "int" or not w.symmetric or w.strategy != "group" or not w.group_size:
            shown = None if w is None else w.model_dump(include={"type", "symmetric", "strategy", "group_size"})
            raise ConversionError(f"{where} = {shown}: only symmetric int weights with per-group scales "
                                  "(Kimi's INT4) are dequantized on import")
        if w.num_bits != 4:
            raise ConversionError(f"{where}.num_bits={w.num_bits}: only int4 is dequantized on import")
        if group.input_activations is not None:
            raise ConversionError(f"quantization_config.config_groups.{name}.input_activations is set: "
                                  "activation quantization has no place in a bf16 training checkpoint")
    return Int4Scheme(raw=quant, config=config)
