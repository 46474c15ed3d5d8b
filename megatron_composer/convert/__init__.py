"""Checkpoint conversion: HF DeepSeek-V3 / Kimi-K2 safetensors <-> megatron-composer DCP.

    from megatron_composer.convert import hf_to_mcore, mcore_to_hf, checkpoint_logits
    hf_to_mcore("DeepSeek-V3/", "ckpt/ds3")          # FP8 weights dequantized to bf16
    mcore_to_hf("ckpt/ds3", "export/ds3")
    logits = checkpoint_logits("ckpt/ds3", [1, 2, 3])  # [3, vocab] fp32

`config` maps config.json <-> ModelConfig (and says what cannot be mapped),
`keys` maps tensor names, `fp8` dequantizes block-scaled FP8, `safetensors_io`
and `dcp_io` stream the two formats, `hf` drives a conversion, `logits` runs
a converted checkpoint. Finding a checkpoint and reading its tensors is
`checkpoint/`'s (`locate_checkpoint`, `load_tensors`), building a model from
one `models/`'s (`load_checkpoint_model`).
"""
from .config import ConversionError, hf_config_from_model, model_config_from_dict, model_config_from_hf
from .fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from .export import mcore_to_hf
from .hf import hf_to_mcore
from .keys import TensorMap, hf_state_dict, mtp_shared_copies, permute_rope_rows, tensor_maps
from .logits import checkpoint_logits

__all__ = [
    "ConversionError",
    "TensorMap",
    "checkpoint_logits",
    "dequantize_fp8_blocks",
    "hf_config_from_model",
    "hf_state_dict",
    "hf_to_mcore",
    "mcore_to_hf",
    "model_config_from_dict",
    "model_config_from_hf",
    "mtp_shared_copies",
    "permute_rope_rows",
    "quantize_fp8_blocks",
    "tensor_maps",
]
