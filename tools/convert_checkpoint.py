"""Convert checkpoints between Hugging Face DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 and megatron-composer.

    python tools/convert_checkpoint.py --direction hf-to-mcore --load Kimi-K2.5/ --save ckpt/k25 --workers 8
    python tools/convert_checkpoint.py --direction mcore-to-hf --load ckpt/k25 --save export/k25 [--export-int4]

hf-to-mcore reads sharded safetensors (per-expert or fused experts, BF16,
DeepSeek's block-scaled FP8 or Kimi's compressed-tensors INT4 experts, all
dequantized) and writes our DCP checkpoint (`latest_checkpointed_iteration.txt`
+ `iter_0000000/`) that `pretrain_cpt.py --load` resumes from. A Kimi-K2.5
directory (config with `text_config`, tensors under `language_model.`) is
read as its text model; its vision tower and projector are kept aside
unchanged (`hf_multimodal/`, with a sha256 manifest) and its tokenizer
(`tiktoken.model`, `tokenizer_config.json`) comes along in `hf_assets/`.
mcore-to-hf writes the published layout back: `config.json` (inside the
Kimi-K2.5 wrapper when the source had one), shards and
`model.safetensors.index.json`, the vision tensors byte for byte, and the
tokenizer the checkpoint carries; `--export-int4` writes the routed experts
as compressed-tensors INT4 (pack-quantized, group 32) for vLLM / SGLang.

Our checkpoint stores tensors under global names (experts by global index),
so it has no parallel layout: `--expert-model-parallel-size` is checked
against the expert count and recorded, and the checkpoint loads under any
EP (and TP=PP=1) size. `--workers` processes convert shards in parallel;
memory stays near `--workers` x `--max-shard-size` whatever the model size.
Output appears only when complete; a killed run leaves SAVE.partial/, and
the same command resumes it.
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_composer.checkpoint import CheckpointError  # noqa: E402
from megatron_composer.convert import ConversionError, hf_to_mcore, mcore_to_hf  # noqa: E402

DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r}; write e.g. 5GB, 500MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--direction", required=True, choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("--load", required=True, help="source checkpoint directory")
    p.add_argument("--save", required=True, help="new output directory")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="hf-to-mcore: EP size to check and record (the layout is EP-independent)")
    p.add_argument("--iteration", type=int, default=None,
                   help="mcore-to-hf: iteration to export (default: the tracker's latest)")
    p.add_argument("--dtype", choices=list(DTYPES), default="keep", help="cast every tensor")
    p.add_argument("--fp8-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="hf-to-mcore: dtype of dequantized FP8 weights")
    p.add_argument("--export-int4", action="store_true",
                   help="mcore-to-hf: routed experts as compressed-tensors INT4 pack-quantized (Kimi K2.5's "
                        "serving format; re-quantizing adds rounding error, see README) instead of --dtype")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="bound on one output file (HF shard or DCP file), hence on memory")
    p.add_argument("--workers", type=int, default=1,
                   help="processes converting shards in parallel (memory: about workers x --max-shard-size)")
    p.add_argument("--overwrite", action="store_true", help="replace --save if it exists")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers {args.workers}; give 1 or more processes", file=sys.stderr)
        return 1
    if args.export_int4 and args.direction != "mcore-to-hf":
        print("error: --export-int4 is an option of --direction mcore-to-hf (import reads INT4 as it is)",
              file=sys.stderr)
        return 1
    try:
        if args.direction == "hf-to-mcore":
            hf_to_mcore(args.load, args.save, expert_model_parallel_size=args.expert_model_parallel_size,
                        dtype=DTYPES[args.dtype], fp8_dtype=DTYPES[args.fp8_dtype],
                        max_file_bytes=args.max_shard_size, overwrite=args.overwrite,
                        progress=not args.no_progress, workers=args.workers)
        else:
            mcore_to_hf(args.load, args.save, iteration=args.iteration, dtype=DTYPES[args.dtype],
                        max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                        progress=not args.no_progress, export_int4=args.export_int4, workers=args.workers)
    except (ConversionError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
