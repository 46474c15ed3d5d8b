"""Block-scaled FP8 weights as DeepSeek-V3 / Kimi-K2 publish them.

The published checkpoints store most linear weights as `float8_e4m3fn` with
one fp32 `weight_scale_inv` per 128 x 128 block (`quantization_config.
weight_block_size`); the last block of a row or column may be ragged. The
real value is `w_fp8 * scale_inv` of its block. We dequantize on import
(megatron-composer trains in BF16/FP32 and quantizes on the fly, see
`quant/`), so a converted checkpoint holds these products and no scales.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """[ceil(r/br), ceil(c/bc)] per-block values -> [r, c] per-element values."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def _check_scale_shape(name: str, shape, scale_shape, block) -> None:
    want = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    if tuple(scale_shape) != want:
        raise ValueError(
            f"{name}: weight_scale_inv has shape {tuple(scale_shape)} but a {tuple(shape)} weight "
            f"with {block[0]}x{block[1]} blocks needs {want}; check quantization_config.weight_block_size"
        )


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
) -> torch.Tensor:
    """Dequantize a block-scaled FP8 matrix.

    Args:
        weight: [rows, cols] float8_e4m3fn.
        scale_inv: [ceil(rows / block[0]), ceil(cols / block[1])] float32, the
            multiplier of each block.
        block: block shape (rows, cols).
        dtype: result dtype; the product is formed in fp32 and rounded once.
        name: tensor name for error messages.
    Returns:
        [rows, cols] `dtype`.
    """
    if weight.ndim != 2:
        raise ValueError(f"{name}: FP8 block dequantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    _check_scale_shape(name, weight.shape, scale_inv.shape, block)
    out = torch.empty(weight.shape, dtype=dtype)
    # Row bands of one block height bound the fp32 temporaries to one band.
    for start in range(0, weight.shape[0], block[0]):
        band = weight[start:start + block[0]].float()
        scale = _expand_blocks(scale_inv[start // block[0]:start // block[0] + 1].float(),
                               (band.shape[0], band.shape[1]), (band.shape[0], block[1]))
        out[start:start + block[0]] = (band * scale).to(dtype)
    return out


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """The inverse recipe (amax / 448 per block), used to make FP8 test checkpoints.

    Args:
        weight: [rows, cols] float.
    Returns:
        (float8_e4m3fn [rows, cols], float32 scale_inv [ceil(rows/b0), ceil(cols/b1)]).
    """
    rows, cols = weight.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(nr * block[0], nc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, block[0], nc, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nr * block[0], nc * block[1])[:rows, :cols].contiguous(), scale_inv
