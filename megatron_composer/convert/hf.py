"""Convert between HF DeepSeek-V3 / Kimi-K2 checkpoints and megatron-composer's.

    hf_to_mcore(hf_dir, out_dir)     published safetensors -> our DCP checkpoint
    mcore_to_hf(ckpt_dir, out_dir)   our DCP checkpoint -> published safetensors

Both stream: HF tensors are read one at a time (`HFCheckpointReader`), our
checkpoint is written file by file (`dcp_io.save_lazily`) and read back in
groups of one output shard (`checkpoint.load_tensors`), so memory stays around
one output file / shard whatever the model size. Both write into a
temporary sibling directory and rename it into place at the end; an
interrupted run leaves `OUT.tmp-PID` behind, never a partial `OUT`.

Our checkpoint stores global tensor names (experts by global index), so it
has no expert-parallel layout to choose: `expert_model_parallel_size` is
only checked (num_experts divisible by it) and recorded in meta.json, and
training loads the checkpoint under any EP size.

Round trip HF -> ours -> HF reproduces every tensor bit for bit (same
dtype), except FP8 checkpoints, whose weights come back dequantized (in
`fp8_dtype`) and without `weight_scale_inv`, and fused-expert checkpoints,
which come back per expert (the published layout).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..config.model import ModelConfig
from ..checkpoint import (
    TRACKER,
    checkpoint_tokenizer,
    iteration_dir,
    load_tensors,
    locate_checkpoint,
    tensor_specs,
)
from ..checkpoint.tracker import HF_ASSETS, TIKTOKEN_MODEL, TOKENIZER_CONFIG, TOKENIZER_MODEL
from ..data.tiktoken_tokenizer import is_tiktoken_file
from ..checkpoint.integrity import write_manifest
from . import dcp_io
from .config import ConversionError, hf_config_from_model, model_config_from_dict, model_config_from_hf
from .int4 import DEFAULT_CONFIG as INT4_DEFAULT_CONFIG, METHOD as INT4_METHOD, PACKED, SCALE, SHAPE, parse_int4_config
from .keys import TensorMap, mtp_shared_copies, permute_rope_rows, tensor_maps
from .multimodal import (
    TEXT_PREFIX,
    export_config,
    keep_aside,
    read_manifest,
    read_source_config,
    restore_tensor,
    tensor_nbytes,
)
from .safetensors_io import _PER_EXPERT, INDEX, HFCheckpointReader, plan_shards, write_shards

_WEIGHT_FILES = (INDEX, "config.json")
_IGNORED_HF = (".rotary_emb.inv_freq",)
_COMPARE_ROWS = 8192


def _log(msg: str) -> None:
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


def _check_destination(final: str, overwrite: bool) -> None:
    if os.path.exists(final) and (not os.path.isdir(final) or os.listdir(final)) and not overwrite:
        raise ConversionError(f"--save {final} exists and is not empty; choose a new directory "
                              "or pass --overwrite")


@contextmanager
def _atomic_output_dir(final: str, overwrite: bool):
    """Yield a temporary directory that becomes `final` only on success."""
    final = os.path.abspath(final)
    _check_destination(final, overwrite)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def _single_process() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConversionError(f"conversion runs in one process, not {dist.get_world_size()} ranks; "
                              "launch it with plain `python`, not torchrun/srun")


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        raise ConversionError(f"missing {path}")
    with open(path) as f:
        return json.load(f)


def _mtp_layers_present(keys, num_layers: int) -> int:
    k = 0
    while any(key.startswith(f"model.layers.{num_layers + k}.") for key in keys):
        k += 1
    return k


def _mcore_tensor(reader: HFCheckpointReader, m: TensorMap, cfg: ModelConfig, interleaved: bool,
                  dtype: Optional[torch.dtype]) -> torch.Tensor:
    parts = [reader.get(name) for name in m.hf]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if m.rope and not interleaved:
        tensor = permute_rope_rows(cfg, m.rope, tensor, to_interleaved=True)
    return tensor if dtype is None else tensor.to(dtype)


def _check_hf_tensors(reader: HFCheckpointReader, maps: list[TensorMap]) -> dict[str, torch.dtype]:
    """Every HF tensor present with the shape config.json implies; returns mcore dtypes."""
    dtypes = {}
    for m in maps:
        if m.mcore is None:
            continue
        kinds = set()
        for name, shape in zip(m.hf, m.shapes):
            if not reader.has(name):
                raise ConversionError(f"{reader.path} lacks tensor {name} (expected shape {shape})")
            got = reader.shape(name)
            if tuple(got) != tuple(shape):
                raise ConversionError(f"{name} has shape {tuple(got)}; config.json implies {shape}")
            kinds.add(reader.dtype(name))
        if len(kinds) != 1:
            raise ConversionError(f"{' and '.join(m.hf)} have different dtypes {sorted(map(str, kinds))}")
        dtypes[m.mcore] = kinds.pop()
    return dtypes


def _check_copies_equal(reader: HFCheckpointReader, pairs: list[tuple[str, str]]) -> list[str]:
    """MTP `embed_tokens` / `shared_head.head` must equal the tensors megatron shares."""
    present = []
    for copy, main in pairs:
        if not reader.has(copy):
            continue
        if reader.shape(copy) != reader.shape(main):
            raise ConversionError(f"{copy} has shape {reader.shape(copy)}, {main} {reader.shape(main)}")
        rows = reader.shape(main)[0]
        for start in range(0, rows, _COMPARE_ROWS):
            end = min(rows, start + _COMPARE_ROWS)
            if not torch.equal(reader.rows(copy, start, end), reader.rows(main, start, end)):
                raise ConversionError(
                    f"{copy} differs from {main}; megatron-core's MTP shares the main model's "
                    "embedding and output head, so this checkpoint cannot be converted exactly"
                )
        present.append(copy)
    return present


def _copy_assets(src: str, dst: str) -> None:
    """Copy the non-weight files (tokenizer, generation config, ...) of src into dst."""
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in _WEIGHT_FILES:
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(path, os.path.join(dst, name))


def _plan_import(reader: HFCheckpointReader, hf: dict, ep: int) -> tuple[ModelConfig, list[TensorMap], dict]:
    """Map config.json, check every tensor against it; (cfg, maps, mcore dtypes)."""
    declared = hf.get("num_nextn_predict_layers") or 0
    present = _mtp_layers_present(reader.keys, int(hf.get("num_hidden_layers", 0)))
    if present == 0 and declared:
        _log(f"config.json declares num_nextn_predict_layers={declared} but the weights hold no "
             "MTP layer; converting without MTP (mtp_num_layers=0)")
    elif present != declared:
        raise ConversionError(
            f"num_nextn_predict_layers={declared} but the weights hold {present} MTP layer(s) "
            f"(model.layers.{hf.get('num_hidden_layers')}...); fix config.json"
        )
    cfg = model_config_from_hf(hf, mtp_layers=present)
    if cfg.num_moe_layers and cfg.num_experts % ep:
        raise ConversionError(f"n_routed_experts={cfg.num_experts} is not divisible by "
                              f"--expert-model-parallel-size {ep}")
    maps = [m for m in tensor_maps(cfg) if m.mcore is not None]
    dtypes = _check_hf_tensors(reader, maps)
    expected = {n for m in maps for n in m.hf}
    expected |= set(_check_copies_equal(reader, mtp_shared_copies(cfg)))
    if not cfg.untie_embeddings_and_output_weights and reader.has("lm_head.weight"):
        expected |= set(_check_copies_equal(reader, [("lm_head.weight", "model.embed_tokens.weight")]))
    used = {key for name in expected for key in reader.storage_keys(name)}
    for key in used:
        if key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            if reader.stored_shape(key)[0] != cfg.num_experts:
                raise ConversionError(f"{key} holds {reader.stored_shape(key)[0]} experts; "
                                      f"config.json says n_routed_experts={cfg.num_experts}")
    unexpected = sorted(k for k in reader.keys - used if not k.endswith(_IGNORED_HF))
    if unexpected:
        raise ConversionError(
            f"{len(unexpected)} tensor(s) of {reader.path} have no place in the model config.json "
            f"describes, e.g. {unexpected[:4]}"
        )
    return cfg, maps, dtypes


def hf_to_mcore(
    load_dir: str,
    save_dir: str,
    expert_model_parallel_size: int = 1,
    dtype: Optional[torch.dtype] = None,
    fp8_dtype: torch.dtype = torch.bfloat16,
    max_file_bytes: int = 2 << 30,
    overwrite: bool = False,
    progress: bool = True,
) -> ModelConfig:
    """Convert an HF DeepSeek-V3 / Kimi-K2 checkpoint directory into our format.

    Args:
        load_dir: holds config.json and model.safetensors(.index.json) shards.
        save_dir: new checkpoint root (tracker file + iter_0000000/).
        expert_model_parallel_size: checked and recorded only (see module doc).
        dtype: cast every tensor to this dtype (None: keep the stored dtypes).
        fp8_dtype: dtype of dequantized FP8 weights (when `dtype` is None).
        max_file_bytes: bound on one DCP data file, hence on peak memory.
    Returns:
        The ModelConfig stored in the checkpoint's meta.json.
    """
    _single_process()
    _check_destination(save_dir, overwrite)
    source = read_source_config(_read_json(os.path.join(load_dir, "config.json")))
    hf = source.text
    with HFCheckpointReader(load_dir, source.fp8_block(), fp8_dtype, prefix=source.prefix,
                            int4=source.int4) as reader:
        if source.wrapper and not reader.keys:
            raise ConversionError(f"config.json has a text_config but no tensor of {load_dir} starts with "
                                  f"{source.prefix!r}; the text model's weights must be stored under it")
        cfg, maps, dtypes = _plan_import(reader, hf, expert_model_parallel_size)
        kept = reader.other_keys  # the vision tower and projector of a multimodal wrapper
        interleaved = bool(hf.get("rope_interleave", True))
        by_name = {m.mcore: m for m in maps}
        specs = {m.mcore: (m.mcore_shape, dtype or dtypes[m.mcore]) for m in maps}
        total = sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())

        def produce(name: str) -> torch.Tensor:
            return _mcore_tensor(reader, by_name[name], cfg, interleaved, dtype)

        meta = {
            "iteration": 0,
            "consumed_samples": 0,
            "skipped_iterations": 0,
            "has_optimizer": False,
            "model_config": asdict(cfg),
            "hf_config": hf,
            "conversion": {
                "source": os.path.abspath(load_dir),
                "rope_interleave": interleaved,
                "fp8_dequantized": source.quant_method == "fp8",
                "int4_dequantized": source.quant_method == INT4_METHOD,
                "fused_experts": reader.fused_experts,
                # a multimodal wrapper (Kimi K2.5): its config, and where the text model's
                # quantization_config sat, for export
                "hf_wrapper_config": source.full if source.wrapper else None,
                "quantization_config": source.quant,
                "quantization_location": source.quant_location,
                "kept_aside_tensors": len(kept),
            },
            "args": {"expert_model_parallel_size": expert_model_parallel_size},
        }
        with _atomic_output_dir(save_dir, overwrite) as tmp:
            it_dir = iteration_dir(tmp, 0)
            with tqdm(total=total, unit="B", unit_scale=True, desc="hf->mcore", disable=not progress) as bar:
                dcp_io.save_lazily(it_dir, specs, produce, max_file_bytes, on_tensor=bar.update)
            if kept:
                keep_aside(reader, kept, tmp, max_file_bytes)
            with open(os.path.join(it_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True, default=str)
            write_manifest(it_dir)  # training verifies converted checkpoints like its own
            with open(os.path.join(tmp, TRACKER), "w") as f:
                f.write("0")
            _copy_assets(load_dir, os.path.join(tmp, HF_ASSETS))
    _log(f"wrote {save_dir}: {cfg.num_layers} layers, {cfg.num_experts} experts, "
         f"{cfg.mtp_num_layers} MTP layer(s), {total / 2**30:.2f} GiB"
         + (f"; {len(kept)} vision tensor(s) kept aside unchanged" if kept else ""))
    return cfg


def _check_stored(it_dir: str, maps: list[TensorMap], stored: dict) -> None:
    for m in maps:
        if m.mcore is None:
            continue
        if m.mcore not in stored:
            raise ConversionError(f"{it_dir} lacks tensor {m.mcore} (expected shape {m.mcore_shape})")
        if stored[m.mcore][0] != m.mcore_shape:
            raise ConversionError(f"{m.mcore} has shape {stored[m.mcore][0]}; model_config implies "
                                  f"{m.mcore_shape}")
    unexpected = sorted(set(stored) - {m.mcore for m in maps})
    if unexpected:
        raise ConversionError(f"{it_dir} holds tensors the DeepSeek-V3 format has no place for, "
                              f"e.g. {unexpected[:4]}")


def _hf_order(cfg: ModelConfig, maps: list[TensorMap]) -> list[str]:
    """HF tensor names in file order; MTP copies of embedding / head sit with
    their layer, as DeepSeek publishes them."""
    order = [n for m in maps for n in m.hf]
    mtp = f"model.layers.{cfg.num_layers}."
    start = next((i for i, n in enumerate(order) if n.startswith(mtp)), len(order))
    order[start:start] = [copy for copy, _ in mtp_shared_copies(cfg)]
    return order


def _export_tokenizer(tokenizer: Optional[str], out: str) -> None:
    """The tokenizer the checkpoint carries, under the name its kind is published with (the one
    training saved wins over an imported HF copy): a SentencePiece `tokenizer.model`, or Kimi's
    `tiktoken.model` with the `tokenizer_config.json` beside it."""
    if tokenizer is None:
        return
    if not is_tiktoken_file(tokenizer):
        shutil.copy2(tokenizer, os.path.join(out, TOKENIZER_MODEL))
        return
    shutil.copy2(tokenizer, os.path.join(out, TIKTOKEN_MODEL))
    config = os.path.join(os.path.dirname(tokenizer), TOKENIZER_CONFIG)
    if os.path.isfile(config):
        shutil.copy2(config, os.path.join(out, TOKENIZER_CONFIG))


def _int4_export_config(conversion: dict) -> dict:
    """The quantization_config `--export-int4` writes: the imported compressed-tensors one (Kimi's
    own groups and ignore list), else Kimi K2.5's scheme for the routed experts."""
    quant = conversion.get("quantization_config")
    if quant and quant.get("quant_method") == INT4_METHOD:
        return dict(quant, quantization_status="compressed")
    return dict(INT4_DEFAULT_CONFIG)


def mcore_to_hf(
    load_dir: str,
    save_dir: str,
    iteration: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool = True,
    export_int4: bool = False,
) -> dict:
    """Convert our checkpoint into a sharded HF DeepSeek-V3 checkpoint; return its config.

    Args:
        load_dir: checkpoint root (latest iteration, or `iteration`) or an
            iter_XXXXXXX directory.
        dtype: cast every tensor (None: keep the stored dtypes).
        max_shard_bytes: bound on one safetensors shard; peak memory is about
            one shard plus its largest tensor.
        export_int4: write the routed experts as compressed-tensors INT4
            (`int4.Int4Scheme.quantize`) instead of `dtype`.

    A checkpoint imported from a multimodal wrapper (Kimi K2.5) is written back
    in that layout: the text model under `language_model.`, its config inside
    the wrapper's `text_config`, and the vision tensors kept aside at import
    restored byte for byte. The output also holds the imported HF checkpoint's
    non-weight files, if any, and the tokenizer the checkpoint carries
    (`checkpoint.checkpoint_tokenizer`).
    """
    _single_process()
    _check_destination(save_dir, overwrite)
    root, _, it_dir, meta = locate_checkpoint(load_dir, iteration)
    if "model_config" not in meta:
        raise ConversionError(f"{it_dir}/meta.json has no model_config")
    cfg = model_config_from_dict(meta["model_config"])
    conversion = meta.get("conversion") or {}
    interleaved = bool(conversion.get("rope_interleave", True))
    prefix = TEXT_PREFIX if conversion.get("hf_wrapper_config") else ""
    kept = read_manifest(root) if prefix else None
    if conversion.get("kept_aside_tensors") and not kept:
        raise ConversionError(f"{root} was imported with {conversion['kept_aside_tensors']} vision tensor(s) kept "
                              "aside, but its hf_multimodal/ directory is missing; copy it along with the "
                              "checkpoint, or re-convert the Hugging Face source")
    int4_config = _int4_export_config(conversion) if export_int4 else None
    int4 = parse_int4_config(int4_config) if int4_config else None
    stored = tensor_specs(it_dir)
    maps = tensor_maps(cfg)
    _check_stored(it_dir, maps, stored)
    copies = dict(mtp_shared_copies(cfg))
    # HF name -> (its map, its part of the megatron tensor)
    part = {name: (m, i) for m in maps for i, name in enumerate(m.hf)}
    part.update({copy: part[main] for copy, main in copies.items()})

    def out_dtype(name: str) -> torch.dtype:
        m, _ = part[name]
        return dtype or (stored[m.mcore][1] if m.mcore else torch.float32)

    def quantized(name: str) -> bool:
        return int4 is not None and _PER_EXPERT.match(name) is not None

    # output tensor name -> (HF name it comes from, INT4 part or None); vision tensors map to None
    outputs: dict[str, Optional[tuple[str, Optional[str]]]] = {}
    for name in _hf_order(cfg, maps):
        if quantized(name):
            module = name[: -len(".weight")]
            outputs.update({f"{prefix}{module}.{p}": (name, p) for p in (PACKED, SCALE, SHAPE)})
        else:
            outputs[prefix + name] = (name, None)
    for key in (kept or {}).get("tensors", {}):
        outputs[key] = None

    def nbytes(out: str) -> int:
        if outputs[out] is None:
            return tensor_nbytes(kept["tensors"][out])
        name, p = outputs[out]
        m, i = part[name]
        rows, cols = m.shapes[i][0], (m.shapes[i][1] if len(m.shapes[i]) > 1 else 1)
        if p == PACKED:
            return rows * -(-cols * 4 // 32) * 4
        if p == SCALE:
            return rows * -(-cols // int4.group_size) * out_dtype(name).itemsize
        if p == SHAPE:
            return 16
        return torch.Size(m.shapes[i]).numel() * out_dtype(name).itemsize

    text_hf = hf_config_from_model(cfg, meta.get("hf_config"), rope_interleave=interleaved,
                                   dtype=str(out_dtype("model.embed_tokens.weight")).replace("torch.", ""))
    hf = export_config(text_hf, conversion, int4_config)
    shards = plan_shards([(n, nbytes(n)) for n in outputs], max_shard_bytes)
    total = sum(nbytes(n) for n in outputs)

    def produce(names: list[str]):
        text = [outputs[n][0] for n in names if outputs[n] is not None]
        uses = Counter(part[n][0].mcore for n in dict.fromkeys(text))
        uses.pop(None, None)
        loaded = load_tensors(it_dir, {s: stored[s] for s in uses})
        packed: dict[str, dict] = {}
        for out in names:
            if outputs[out] is None:
                yield out, restore_tensor(root, kept, out)
                continue
            name, p = outputs[out]
            if p is not None and name in packed:
                yield out, packed[name][p]
                continue
            m, i = part[name]
            if m.mcore is None:  # e_score_correction_bias of a model without expert bias
                tensor = torch.zeros(m.shapes[i], dtype=out_dtype(name))
            else:
                full = loaded[m.mcore]
                if m.rope and not interleaved:
                    full = permute_rope_rows(cfg, m.rope, full, to_interleaved=False)
                start = sum(s[0] for s in m.shapes[:i])
                # a copy: safetensors refuses views that share one storage
                tensor = full[start:start + m.shapes[i][0]].to(out_dtype(name), copy=True)
                del full
                uses[m.mcore] -= 1
                if not uses[m.mcore]:
                    del loaded[m.mcore]  # keeps the peak near one shard
            if p is not None:
                packed[name] = int4.quantize(prefix + name[: -len(".weight")], tensor)
                yield out, packed[name][p]
            else:
                yield out, tensor

    with _atomic_output_dir(save_dir, overwrite) as tmp:
        assets = os.path.join(root, HF_ASSETS)
        if os.path.isdir(assets):
            _copy_assets(assets, tmp)
        _export_tokenizer(checkpoint_tokenizer(root), tmp)
        with tqdm(total=total, unit="B", unit_scale=True, desc="mcore->hf", disable=not progress) as bar:
            write_shards(tmp, shards, produce, on_bytes=bar.update)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
    _log(f"wrote {save_dir}: {len(shards)} shard(s), {total / 2**30:.2f} GiB"
         + (", routed experts in INT4" if int4 else ""))
    return hf
