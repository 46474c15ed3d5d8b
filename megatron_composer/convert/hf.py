"""Convert between HF DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 checkpoints and megatron-composer's.

    hf_to_mcore(hf_dir, out_dir)     published safetensors -> our DCP checkpoint
    mcore_to_hf(ckpt_dir, out_dir)   our DCP checkpoint -> published safetensors (`export`)

Both stream and both are split into independent jobs (`jobs`): import runs
one job per input shard, reading its tensors one at a time
(`HFCheckpointReader`) and writing them as a DCP part in files of bounded
size (`dcp_io.save_lazily`); the parts are merged into one checkpoint at the
end. Export runs one job per output shard, reading that shard's tensors back
(`checkpoint.load_tensors`). Memory stays around `workers` output files
whatever the model size; `workers` processes run jobs in parallel; a killed
run leaves `OUT.partial/`, which the same command resumes, never a partial
`OUT`.

Our checkpoint stores global tensor names (experts by global index), so it
has no expert-parallel layout to choose: `expert_model_parallel_size` is
only checked (num_experts divisible by it) and recorded in meta.json, and
training loads the checkpoint under any EP size.

Round trip HF -> ours -> HF reproduces every tensor bit for bit (same
dtype), except FP8 and INT4 checkpoints, whose weights come back dequantized
(FP8 in `fp8_dtype`, INT4 in its scales' dtype) unless exported with
`export_int4`, and fused-expert checkpoints, which come back per expert (the
published layout). Kimi K2.5's multimodal wrapper (`multimodal`) comes back
as it was: the vision tower and projector byte for byte.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..checkpoint import TRACKER, iteration_dir
from ..checkpoint.integrity import write_manifest
from ..checkpoint.tracker import HF_ASSETS
from ..config.model import ModelConfig
from . import dcp_io
from .config import ConversionError, model_config_from_hf
from .int4 import METHOD as INT4_METHOD
from .jobs import ResumableOutput, file_fingerprint, merge_parts, report_bytes, run_jobs
from .keys import TensorMap, mtp_shared_copies, permute_rope_rows, tensor_maps
from .multimodal import MULTIMODAL_DIR, keep_aside, read_source_config
from .safetensors_io import INDEX, HFCheckpointReader

_WEIGHT_FILES = (INDEX, "config.json")
_IGNORED_HF = (".rotary_emb.inv_freq",)
_COMPARE_ROWS = 8192


def _log(msg: str) -> None:
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


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


def _open_reader(load_dir: str, full_config: dict, fp8_dtype: torch.dtype):
    source = read_source_config(full_config)
    return source, HFCheckpointReader(load_dir, source.fp8_block(), fp8_dtype, prefix=source.prefix,
                                      int4=source.int4)


def _import_shard(load_dir: str, full_config: dict, fp8_dtype: torch.dtype, dtype: Optional[torch.dtype],
                  cfg: ModelConfig, maps: list[TensorMap], specs: dict, interleaved: bool, part_dir: str,
                  max_file_bytes: int) -> dict:
    """One import job: the megatron tensors `maps` (those whose first HF tensor lies in one input
    shard) as a DCP checkpoint at `part_dir`. Runs in a worker process."""
    shutil.rmtree(part_dir, ignore_errors=True)  # debris of a killed attempt
    _, reader = _open_reader(load_dir, full_config, fp8_dtype)
    by_name = {m.mcore: m for m in maps}
    with reader:
        dcp_io.save_lazily(part_dir, specs, lambda name: _mcore_tensor(reader, by_name[name], cfg, interleaved, dtype),
                           max_file_bytes, on_tensor=report_bytes)
    return {"bytes": sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())}


def _keep_aside_job(load_dir: str, full_config: dict, keys: list[str], root: str, max_file_bytes: int) -> dict:
    shutil.rmtree(os.path.join(root, MULTIMODAL_DIR), ignore_errors=True)
    _, reader = _open_reader(load_dir, full_config, torch.bfloat16)
    with reader:
        keep_aside(reader, keys, root, max_file_bytes)
    return {"bytes": 0}


def _source_files(load_dir: str, reader: HFCheckpointReader) -> list[str]:
    names = ["config.json", *sorted(set(reader.weight_map.values()))]
    if os.path.exists(os.path.join(load_dir, INDEX)):
        names.append(INDEX)
    return [os.path.join(load_dir, n) for n in names]


def hf_to_mcore(
    load_dir: str,
    save_dir: str,
    expert_model_parallel_size: int = 1,
    dtype: Optional[torch.dtype] = None,
    fp8_dtype: torch.dtype = torch.bfloat16,
    max_file_bytes: int = 2 << 30,
    overwrite: bool = False,
    progress: bool = True,
    workers: int = 1,
) -> ModelConfig:
    """Convert an HF DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 checkpoint directory into our format.

    Args:
        load_dir: holds config.json and model.safetensors(.index.json) shards.
        save_dir: new checkpoint root (tracker file + iter_0000000/).
        expert_model_parallel_size: checked and recorded only (see module doc).
        dtype: cast every tensor to this dtype (None: keep the stored dtypes).
        fp8_dtype: dtype of dequantized FP8 weights (when `dtype` is None).
        max_file_bytes: bound on one DCP data file, hence on peak memory (per worker).
        workers: processes converting input shards in parallel.
    Returns:
        The ModelConfig stored in the checkpoint's meta.json.
    """
    _single_process()
    full = _read_json(os.path.join(load_dir, "config.json"))
    source, reader = _open_reader(load_dir, full, fp8_dtype)
    hf = source.text
    with reader:
        if source.wrapper and not reader.keys:
            raise ConversionError(f"config.json has a text_config but no tensor of {load_dir} starts with "
                                  f"{source.prefix!r}; the text model's weights must be stored under it")
        cfg, maps, dtypes = _plan_import(reader, hf, expert_model_parallel_size)
        kept = reader.other_keys  # the vision tower and projector of a multimodal wrapper
        by_shard: dict[str, list[TensorMap]] = {}
        for m in maps:
            by_shard.setdefault(reader.shard_of(m.hf[0]), []).append(m)
        files = _source_files(load_dir, reader)
        fused = reader.fused_experts
    interleaved = bool(hf.get("rope_interleave", True))
    specs = {m.mcore: (m.mcore_shape, dtype or dtypes[m.mcore]) for m in maps}
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())
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
            "fused_experts": fused,
            # a multimodal wrapper (Kimi K2.5): its config, and where the text model's
            # quantization_config sat, for export
            "hf_wrapper_config": full if source.wrapper else None,
            "quantization_config": source.quant,
            "quantization_location": source.quant_location,
            "kept_aside_tensors": len(kept),
        },
        "args": {"expert_model_parallel_size": expert_model_parallel_size},
    }
    plan = {"direction": "hf-to-mcore", "source": os.path.abspath(load_dir), "files": file_fingerprint(files),
            "dtype": dtype, "fp8_dtype": fp8_dtype, "max_file_bytes": max_file_bytes, "meta": meta}
    with ResumableOutput(save_dir, plan, overwrite) as out:
        parts = os.path.join(out.work, "parts")
        jobs = {}
        for i, (shard, shard_maps) in enumerate(sorted(by_shard.items())):
            part_specs = {m.mcore: specs[m.mcore] for m in shard_maps}
            jobs[f"part-{i:05d}"] = (load_dir, full, fp8_dtype, dtype, cfg, shard_maps, part_specs, interleaved,
                                     os.path.join(parts, f"part-{i:05d}"), max_file_bytes)
        with tqdm(total=total, unit="B", unit_scale=True, desc="hf->mcore", disable=not progress) as bar:
            if kept:
                run_jobs({"multimodal": (load_dir, full, kept, out.path, max_file_bytes)}, _keep_aside_job, out,
                         1, bar)
            run_jobs(jobs, _import_shard, out, workers, bar)
        it_dir = iteration_dir(out.path, 0)
        merge_parts([os.path.join(parts, name) for name in jobs], it_dir)
        with open(os.path.join(it_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True, default=str)
        write_manifest(it_dir)  # training verifies converted checkpoints like its own
        with open(os.path.join(out.path, TRACKER), "w") as f:
            f.write("0")
        _copy_assets(load_dir, os.path.join(out.path, HF_ASSETS))
        out.publish()
    _log(f"wrote {save_dir}: {cfg.num_layers} layers, {cfg.num_experts} experts, "
         f"{cfg.mtp_num_layers} MTP layer(s), {total / 2**30:.2f} GiB"
         + (f"; {len(kept)} vision tensor(s) kept aside unchanged" if kept else ""))
    return cfg
