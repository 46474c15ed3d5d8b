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
from ..checkpoint.tracker import HF_ASSETS, TOKENIZER_MODEL
from ..checkpoint.integrity import write_manifest
from . import dcp_io
from .config import ConversionError, hf_config_from_model, model_config_from_dict, model_config_from_hf
from .keys import TensorMap, hf_part, mtp_shared_copies, permute_rope_rows, tensor_maps
from .safetensors_io import INDEX, HFCheckpointReader, plan_shards, write_shards

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


def _fp8_block(hf: dict) -> tuple[int, int]:
    quant = hf.get("quantization_config")
    if not quant:
        return (128, 128)
    method = quant.get("quant_method")
    if method != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise ConversionError(
            f"quantization_config.quant_method={method!r} fmt={quant.get('fmt')!r}: only DeepSeek's "
            "block-scaled fp8 (e4m3) weights are dequantized on import"
        )
    return tuple(quant.get("weight_block_size") or (128, 128))


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
    hf = _read_json(os.path.join(load_dir, "config.json"))
    with HFCheckpointReader(load_dir, _fp8_block(hf), fp8_dtype) as reader:
        cfg, maps, dtypes = _plan_import(reader, hf, expert_model_parallel_size)
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
                "fp8_dequantized": "quantization_config" in hf,
                "fused_experts": reader.fused_experts,
            },
            "args": {"expert_model_parallel_size": expert_model_parallel_size},
        }
        with _atomic_output_dir(save_dir, overwrite) as tmp:
            it_dir = iteration_dir(tmp, 0)
            with tqdm(total=total, unit="B", unit_scale=True, desc="hf->mcore", disable=not progress) as bar:
                dcp_io.save_lazily(it_dir, specs, produce, max_file_bytes, on_tensor=bar.update)
            with open(os.path.join(it_dir, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True, default=str)
            write_manifest(it_dir)  # training verifies converted checkpoints like its own
            with open(os.path.join(tmp, TRACKER), "w") as f:
                f.write("0")
            _copy_assets(load_dir, os.path.join(tmp, HF_ASSETS))
    _log(f"wrote {save_dir}: {cfg.num_layers} layers, {cfg.num_experts} experts, "
         f"{cfg.mtp_num_layers} MTP layer(s), {total / 2**30:.2f} GiB")
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


def mcore_to_hf(
    load_dir: str,
    save_dir: str,
    iteration: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Convert our checkpoint into a sharded HF DeepSeek-V3 checkpoint; return its config.

    Args:
        load_dir: checkpoint root (latest iteration, or `iteration`) or an
            iter_XXXXXXX directory.
        dtype: cast every tensor (None: keep the stored dtypes).
        max_shard_bytes: bound on one safetensors shard; peak memory is about
            one shard plus its largest tensor.

    The output also holds the imported HF checkpoint's non-weight files, if
    any, and the tokenizer the checkpoint carries (`checkpoint.checkpoint_tokenizer`).
    """
    _single_process()
    _check_destination(save_dir, overwrite)
    root, _, it_dir, meta = locate_checkpoint(load_dir, iteration)
    if "model_config" not in meta:
        raise ConversionError(f"{it_dir}/meta.json has no model_config")
    cfg = model_config_from_dict(meta["model_config"])
    interleaved = bool(meta.get("conversion", {}).get("rope_interleave", True))
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

    def nbytes(name: str) -> int:
        m, i = part[name]
        return torch.Size(m.shapes[i]).numel() * out_dtype(name).itemsize

    hf = hf_config_from_model(cfg, meta.get("hf_config"), rope_interleave=interleaved,
                              dtype=str(out_dtype("model.embed_tokens.weight")).replace("torch.", ""))
    order = _hf_order(cfg, maps)
    shards = plan_shards([(n, nbytes(n)) for n in order], max_shard_bytes)
    total = sum(nbytes(n) for n in order)

    def produce(names: list[str]):
        uses = Counter(part[n][0].mcore for n in names)
        uses.pop(None, None)
        loaded = load_tensors(it_dir, {s: stored[s] for s in uses})
        for name in names:
            m, i = part[name]
            # a zero e_score_correction_bias for a model without expert bias (m.mcore None)
            tensor = hf_part(cfg, m, i, loaded.get(m.mcore), interleaved, out_dtype(name))
            if m.mcore is not None:
                uses[m.mcore] -= 1
                if not uses[m.mcore]:
                    del loaded[m.mcore]  # keeps the peak near one shard
            yield name, tensor

    with _atomic_output_dir(save_dir, overwrite) as tmp:
        assets = os.path.join(root, HF_ASSETS)
        if os.path.isdir(assets):
            _copy_assets(assets, tmp)
        tokenizer = checkpoint_tokenizer(root)
        if tokenizer is not None:  # the one training saved wins over an imported HF copy
            shutil.copy2(tokenizer, os.path.join(tmp, TOKENIZER_MODEL))
        with tqdm(total=total, unit="B", unit_scale=True, desc="mcore->hf", disable=not progress) as bar:
            write_shards(tmp, shards, produce, on_bytes=bar.update)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
    _log(f"wrote {save_dir}: {len(shards)} shard(s), {total / 2**30:.2f} GiB")
    return hf
