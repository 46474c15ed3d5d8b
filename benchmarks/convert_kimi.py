"""Conversion rate on a Kimi-K2.5-layout checkpoint, and the projected time for the real 1T one.

    python benchmarks/convert_kimi.py [--hidden 2048] [--experts 32] [--layers 4] [--workers 1 2]

Writes a synthetic checkpoint in the published layout (`kimi_k25` wrapper,
text tensors under `language_model.`, routed experts as compressed-tensors
INT4 `weight_packed` / `weight_scale` / `weight_shape` with random codes,
bf16 elsewhere, a vision stub), one input shard per layer like the
published index, then times `hf_to_mcore` (INT4 dequantized to bf16) and
`mcore_to_hf` (bf16, and `--export-int4`) at each worker count. Prints MB/s
of checkpoint read (input) and written (output) per wall second and input MB
per CPU second (the workers' included), and the time the CPU rate gives for
Kimi K2.5's own sizes, computed from the `kimi-k2.5` preset's tensors (INT4
routed experts in, bf16 out), on one core and on 32 (`--workers 32`, if the
disks keep up: 2 TB of bf16 is written on import).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from megatron_composer.config import get_preset  # noqa: E402
from megatron_composer.convert import hf_config_from_model, hf_to_mcore, mcore_to_hf  # noqa: E402
from megatron_composer.convert.int4 import DEFAULT_CONFIG  # noqa: E402
from megatron_composer.convert.keys import tensor_maps  # noqa: E402

EXPERT = (".mlp.experts.",)


def _int4_bytes(shape) -> int:
    rows, cols = shape
    return rows * cols // 2 + rows * (cols // 32) * 2 + 16


def checkpoint_bytes(cfg) -> tuple[int, int]:
    """(published bytes with INT4 routed experts and bf16 elsewhere, bf16 bytes of everything)."""
    published = bf16 = 0
    for m in tensor_maps(cfg):
        for name, shape in zip(m.hf, m.shapes):
            numel = torch.Size(shape).numel()
            bf16 += 2 * numel
            published += _int4_bytes(shape) if any(e in name for e in EXPERT) else 2 * numel
    return published, bf16


def write_synthetic(path: str, cfg) -> int:
    """The checkpoint described in the module docstring; returns its tensor bytes."""
    g = torch.Generator().manual_seed(0)
    hf = hf_config_from_model(cfg)
    hf["quantization_config"] = DEFAULT_CONFIG
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": hf,
              "vision_config": {"vt_hidden_size": 64}}
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shards: dict[str, dict] = {"vision": {"vision_tower.patch_embed.proj.weight": (64, 3, 14, 14),
                                          "mm_projector.proj.0.weight": (cfg.hidden_size, 256)}}
    for m in tensor_maps(cfg):
        for name, shape in zip(m.hf, m.shapes):
            layer = name.split(".")[2] if name.startswith("model.layers.") else "other"
            shards.setdefault(layer, {})["language_model." + name] = shape
    weight_map, total = {}, 0
    for i, (layer, tensors) in enumerate(shards.items()):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for name, shape in tensors.items():
            if any(e in name for e in EXPERT):
                module = name[: -len(".weight")]
                rows, cols = shape
                data[module + ".weight_packed"] = torch.randint(-2**31, 2**31 - 1, (rows, cols // 8),
                                                                dtype=torch.int32, generator=g)
                data[module + ".weight_scale"] = (torch.rand(rows, cols // 32, generator=g) * 0.01).bfloat16()
                data[module + ".weight_shape"] = torch.tensor(shape)
            else:
                data[name] = torch.randn(shape, generator=g).bfloat16()
        total += sum(t.numel() * t.element_size() for t in data.values())
        save_file(data, os.path.join(path, fname))
        weight_map.update({k: fname for k in data})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return total


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the spawned workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args(argv)
    cfg = get_preset("kimi-k2.5").replace(
        hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden, moe_ffn_hidden_size=args.hidden // 2,
        moe_shared_expert_intermediate_size=args.hidden // 2, num_experts=args.experts, moe_router_topk=2,
        num_layers=args.layers, num_attention_heads=8, vocab_size=16384, mtp_num_layers=0)
    scratch = args.dir or tempfile.mkdtemp(prefix="convert_kimi_")
    try:
        src = os.path.join(scratch, "hf")
        size_in = write_synthetic(src, cfg)
        print(f"synthetic Kimi-K2.5 layout: {size_in / 1e6:.0f} MB in {args.layers + 2} shards "
              f"({torch.get_num_threads()} torch threads, {os.cpu_count()} cores)")
        rows = []
        for workers in args.workers:
            for name, fn in (
                ("hf->mcore (INT4 -> bf16)", lambda w: hf_to_mcore(src, os.path.join(scratch, f"mc{w}"), workers=w,
                                                                   max_file_bytes=256 << 20, progress=False)),
                ("mcore->hf bf16", lambda w: mcore_to_hf(os.path.join(scratch, f"mc{w}"),
                                                         os.path.join(scratch, f"bf{w}"), workers=w,
                                                         max_shard_bytes=256 << 20, progress=False)),
                ("mcore->hf --export-int4", lambda w: mcore_to_hf(os.path.join(scratch, f"mc{w}"),
                                                                  os.path.join(scratch, f"i4{w}"), workers=w,
                                                                  export_int4=True, max_shard_bytes=256 << 20,
                                                                  progress=False)),
            ):
                start, cpu = time.perf_counter(), _cpu_seconds()
                fn(workers)
                rows.append((name, workers, time.perf_counter() - start, _cpu_seconds() - cpu))
        ours = _bytes_under(os.path.join(scratch, "mc1"))
        sizes = {"hf->mcore (INT4 -> bf16)": (size_in, ours),
                 "mcore->hf bf16": (ours, _bytes_under(os.path.join(scratch, "bf1"))),
                 "mcore->hf --export-int4": (ours, _bytes_under(os.path.join(scratch, "i41")))}
        published, bf16 = checkpoint_bytes(get_preset("kimi-k2.5"))
        print(f"Kimi K2.5 text model: {published / 1e9:.0f} GB published (INT4 experts), {bf16 / 1e9:.0f} GB bf16")
        print(f"{'direction':26s} {'workers':>7s} {'wall s':>7s} {'CPU s':>6s} {'MB/s in':>8s} {'MB/s out':>9s} "
              f"{'in MB/CPU-s':>11s} {'1T, 1 core':>10s} {'1T, 32 cores':>12s}")
        for name, workers, seconds, cpu in rows:
            read, written = sizes[name]
            full_in = published if name.startswith("hf->") else bf16
            per_cpu = read / cpu
            print(f"{name:26s} {workers:7d} {seconds:7.1f} {cpu:6.1f} {read / seconds / 1e6:8.1f} "
                  f"{written / seconds / 1e6:9.1f} {per_cpu / 1e6:11.1f} {full_in / per_cpu / 3600:8.1f} h "
                  f"{full_in / per_cpu / 32 / 3600:10.1f} h")
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
