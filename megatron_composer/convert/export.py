"""Our checkpoint -> a published HF checkpoint (DeepSeek-V3, Kimi-K2, Kimi-K2.5 layouts).

`mcore_to_hf` plans every output tensor and its shard up front
(`ExportPlan`), then writes the shards as independent jobs (`jobs.run_jobs`:
parallel, resumable). A job loads only the megatron tensors its shard needs
(`checkpoint.load_tensors`), so memory is about one shard per worker.

What an output tensor can be:

* a text-model tensor: a row block of one megatron tensor, cast to `dtype`,
  under `language_model.` for a checkpoint imported from Kimi K2.5's wrapper;
* with `export_int4`, a routed expert's `weight_packed` / `weight_scale` /
  `weight_shape` (`int4.Int4Scheme.quantize`, compressed-tensors' packing);
* a vision tensor kept aside at import (`multimodal.restore_tensor`: checked
  against its sha256, written byte for byte).
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..checkpoint import checkpoint_tokenizer, load_tensors, locate_checkpoint, tensor_specs
from ..checkpoint.tracker import HF_ASSETS, TIKTOKEN_MODEL, TOKENIZER_CONFIG, TOKENIZER_MODEL
from ..config.model import ModelConfig
from ..data.tiktoken_tokenizer import is_tiktoken_file
from .config import ConversionError, hf_config_from_model, model_config_from_dict
from .hf import _copy_assets, _log, _single_process
from .int4 import DEFAULT_CONFIG as INT4_DEFAULT_CONFIG, METHOD as INT4_METHOD, PACKED, SCALE, SHAPE
from .int4 import parse_int4_config
from .jobs import ResumableOutput, file_fingerprint, report_bytes, run_jobs
from .keys import TensorMap, hf_part, mtp_shared_copies, tensor_maps
from .multimodal import TEXT_PREFIX, export_config, read_manifest, restore_tensor, tensor_nbytes
from .safetensors_io import _PER_EXPERT, INDEX, plan_shards, shard_name


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


@dataclass
class ExportPlan:
    """Everything one export job needs (picklable: it travels to worker processes).

    outputs: output tensor name -> (HF name it comes from, INT4 part or None), or None
    for a kept-aside vision tensor.
    """

    root: str
    it_dir: str
    cfg: ModelConfig
    stored: dict
    interleaved: bool
    dtype: Optional[torch.dtype]
    prefix: str
    kept: Optional[dict]
    int4_config: Optional[dict]
    outputs: dict = field(default_factory=dict)

    def __post_init__(self):
        maps = tensor_maps(self.cfg)
        # HF name -> (its map, its part of the megatron tensor)
        self._part = {name: (m, i) for m in maps for i, name in enumerate(m.hf)}
        self._part.update({copy: self._part[main] for copy, main in mtp_shared_copies(self.cfg)})
        self._int4 = parse_int4_config(self.int4_config) if self.int4_config else None
        if not self.outputs:
            for name in _hf_order(self.cfg, maps):
                if self._int4 is not None and _PER_EXPERT.match(name):
                    module = name[: -len(".weight")]
                    self.outputs.update({f"{self.prefix}{module}.{p}": (name, p) for p in (PACKED, SCALE, SHAPE)})
                else:
                    self.outputs[self.prefix + name] = (name, None)
            for key in (self.kept or {}).get("tensors", {}):
                self.outputs[key] = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__post_init__()

    def out_dtype(self, name: str) -> torch.dtype:
        m, _ = self._part[name]
        return self.dtype or (self.stored[m.mcore][1] if m.mcore else torch.float32)

    def nbytes(self, out: str) -> int:
        if self.outputs[out] is None:
            return tensor_nbytes(self.kept["tensors"][out])
        name, p = self.outputs[out]
        m, i = self._part[name]
        shape = m.shapes[i]
        if p == PACKED:
            return shape[0] * -(-shape[1] * 4 // 32) * 4
        if p == SCALE:
            return shape[0] * -(-shape[1] // self._int4.group_size) * self.out_dtype(name).itemsize
        if p == SHAPE:
            return 2 * 8
        return torch.Size(shape).numel() * self.out_dtype(name).itemsize

    def produce(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of one output shard, in order; the megatron tensors they need are loaded
        once and dropped after their last use."""
        text = dict.fromkeys(self.outputs[n][0] for n in names if self.outputs[n] is not None)
        uses = Counter(self._part[n][0].mcore for n in text)
        uses.pop(None, None)
        loaded = load_tensors(self.it_dir, {s: self.stored[s] for s in uses})
        packed: dict[str, dict] = {}
        for out in names:
            if self.outputs[out] is None:
                yield out, restore_tensor(self.root, self.kept, out)
                continue
            name, p = self.outputs[out]
            if p is not None and name in packed:
                yield out, packed[name][p]
                continue
            tensor = self._hf_tensor(name, loaded, uses)
            if p is None:
                yield out, tensor
            else:
                packed[name] = self._int4.quantize(self.prefix + name[: -len(".weight")], tensor)
                yield out, packed[name][p]

    def _hf_tensor(self, name: str, loaded: dict, uses: Counter) -> torch.Tensor:
        m, i = self._part[name]
        # a zero e_score_correction_bias for a model without expert bias (m.mcore None)
        tensor = hf_part(self.cfg, m, i, loaded.get(m.mcore), self.interleaved, self.out_dtype(name))
        if m.mcore is not None:
            uses[m.mcore] -= 1
            if not uses[m.mcore]:
                del loaded[m.mcore]  # keeps the peak near one shard
        return tensor


def _export_shard(plan: ExportPlan, out_dir: str, fname: str, names: list[str]) -> dict:
    """One export job: write shard `fname` (atomically: a killed job leaves only a .tmp)."""
    tensors = dict(plan.produce(names))
    missing = set(names) - set(tensors)
    if missing:
        raise ConversionError(f"internal: shard {fname} produced no {sorted(missing)[:3]}")
    tmp = os.path.join(out_dir, fname + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, fname))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    report_bytes(nbytes)
    return {"bytes": nbytes}


def mcore_to_hf(
    load_dir: str,
    save_dir: str,
    iteration: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool = True,
    export_int4: bool = False,
    workers: int = 1,
) -> dict:
    """Convert our checkpoint into a sharded HF checkpoint; return its config.json.

    Args:
        load_dir: checkpoint root (latest iteration, or `iteration`) or an
            iter_XXXXXXX directory.
        dtype: cast every tensor (None: keep the stored dtypes).
        max_shard_bytes: bound on one safetensors shard; peak memory is about
            one shard plus its largest tensor, per worker.
        export_int4: write the routed experts as compressed-tensors INT4
            (`int4.Int4Scheme.quantize`) instead of `dtype`.
        workers: processes writing shards in parallel.

    A checkpoint imported from a multimodal wrapper (Kimi K2.5) is written back
    in that layout: the text model under `language_model.`, its config inside
    the wrapper's `text_config`, and the vision tensors kept aside at import
    restored byte for byte. The output also holds the imported HF checkpoint's
    non-weight files, if any, and the tokenizer the checkpoint carries
    (`checkpoint.checkpoint_tokenizer`).
    """
    _single_process()
    root, _, it_dir, meta = locate_checkpoint(load_dir, iteration)
    if "model_config" not in meta:
        raise ConversionError(f"{it_dir}/meta.json has no model_config")
    cfg = model_config_from_dict(meta["model_config"])
    conversion = meta.get("conversion") or {}
    prefix = TEXT_PREFIX if conversion.get("hf_wrapper_config") else ""
    kept = read_manifest(root) if prefix else None
    if conversion.get("kept_aside_tensors") and not kept:
        raise ConversionError(f"{root} was imported with {conversion['kept_aside_tensors']} vision tensor(s) kept "
                              "aside, but its hf_multimodal/ directory is missing; copy it along with the "
                              "checkpoint, or re-convert the Hugging Face source")
    stored = tensor_specs(it_dir)
    _check_stored(it_dir, tensor_maps(cfg), stored)
    int4_config = _int4_export_config(conversion) if export_int4 else None
    plan = ExportPlan(root, it_dir, cfg, stored, bool(conversion.get("rope_interleave", True)), dtype, prefix,
                      kept, int4_config)
    text_hf = hf_config_from_model(cfg, meta.get("hf_config"), rope_interleave=plan.interleaved,
                                   dtype=str(plan.out_dtype("model.embed_tokens.weight")).replace("torch.", ""))
    hf = export_config(text_hf, conversion, int4_config)
    sizes = {n: plan.nbytes(n) for n in plan.outputs}
    shards = plan_shards(list(sizes.items()), max_shard_bytes)
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    fingerprint = {"direction": "mcore-to-hf", "source": it_dir, "dtype": dtype, "export_int4": export_int4,
                   "max_shard_bytes": max_shard_bytes, "config": hf,
                   "files": file_fingerprint([os.path.join(it_dir, ".metadata"), os.path.join(it_dir, "meta.json")])}
    with ResumableOutput(save_dir, fingerprint, overwrite) as out:
        jobs = {fname: (plan, out.path, fname, shard) for fname, shard in zip(names, shards)}
        with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="mcore->hf",
                  disable=not progress) as bar:
            results = run_jobs(jobs, _export_shard, out, workers, bar)
        weight_map = {n: fname for fname, shard in zip(names, shards) for n in shard}
        total = sum(results[fname]["bytes"] for fname in names)
        with open(os.path.join(out.path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        assets = os.path.join(root, HF_ASSETS)
        if os.path.isdir(assets):
            _copy_assets(assets, out.path)
        _export_tokenizer(checkpoint_tokenizer(root), out.path)
        with open(os.path.join(out.path, "config.json"), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
        out.publish()
    _log(f"wrote {save_dir}: {len(shards)} shard(s), {total / 2**30:.2f} GiB"
         + (", routed experts in INT4" if export_int4 else ""))
    return hf
