"""Check a machine before a run: `python -m megatron_composer.platform.doctor [--json]`.

Prints the versions that decide what a run can use (Python, torch and the
CUDA / cuDNN / NCCL it was built with, megatron-core, Transformer Engine,
flash-attn, Triton), every visible GPU with its compute capability and
generation, and which low-precision expert recipes run there:

* Transformer Engine's FP8 / FP4 recipes (`--fp8-recipe`, `--fp4-recipe`),
  by GPU generation (`platform.recipes.available_recipes`) and only when TE
  imports;
* our own `--moe-expert-precision nvfp4|mxfp8` (the bit-exact emulation),
  which runs anywhere, with Triton quantizers on CUDA when Triton imports.

Exit status 1 when something a run needs is missing or mismatched
(megatron-core not 0.16.1, a Transformer Engine outside the range megatron-core
0.16.1 supports); warnings do not fail it.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys

MEGATRON_CORE = "0.16.1"
# What megatron-core 0.16.1 supports (and the `[gpu]` extra pins).
TE_RANGE = ((2, 9), (2, 12))


def _version(distribution: str, module: str):
    """Installed version of a package, or None when it does not import."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # an import that fails for any reason means "not usable here"
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(mod, "__version__", "unknown")


def _te_in_range(version: str) -> bool:
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return TE_RANGE[0] <= (major, minor) < TE_RANGE[1]


def report() -> dict:
    """Everything the doctor prints, as a dict (see `--json`)."""
    import torch

    from .recipes import available_recipes, generation

    cuda = torch.cuda.is_available()
    te = (_version("transformer_engine", "transformer_engine")
          or _version("transformer-engine", "transformer_engine"))
    triton = _version("triton", "triton")
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "megatron_core": _version("megatron-core", "megatron.core"),
        "transformer_engine": te,
        "flash_attn": _version("flash-attn", "flash_attn"),
        "triton": triton,
        "cuda_available": cuda,
        "gpus": [],
        "problems": [],
        "warnings": [],
    }
    for i in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(i)
        cap = (props.major, props.minor)
        tensor_recipes = available_recipes(cap)
        info["gpus"].append({
            "index": i, "name": props.name, "capability": f"{cap[0]}.{cap[1]}",
            "generation": generation(cap), "memory_gib": round(props.total_memory / 2**30, 1),
            "bf16": torch.cuda.is_bf16_supported(),
            "te_recipes": tensor_recipes if te else [],
            "te_recipes_with_te_installed": tensor_recipes,
            "moe_expert_precision": ["bf16", "mxfp8", "nvfp4"],
            "triton_quantizers": triton is not None,
        })
    mc = info["megatron_core"]
    if mc is None:
        info["problems"].append(f"megatron-core does not import; pip install megatron-core=={MEGATRON_CORE}")
    elif mc != MEGATRON_CORE:
        info["problems"].append(f"megatron-core {mc} installed; this version of megatron-composer is "
                                f"checked against {MEGATRON_CORE} (pip install megatron-core=={MEGATRON_CORE})")
    if te is not None and not _te_in_range(te):
        lo, hi = (".".join(map(str, v)) for v in TE_RANGE)
        info["problems"].append(f"transformer-engine {te} is outside what megatron-core {MEGATRON_CORE} "
                                f"supports (>={lo},<{hi}); pip install -e '.[gpu]'")
    if cuda and te is None:
        info["warnings"].append("Transformer Engine not installed: --transformer-impl defaults to local, "
                                "no TE FP8/FP4 recipes (pip install -e '.[gpu]' or an NGC PyTorch container)")
    if torch.version.cuda and not cuda:
        info["warnings"].append("torch was built with CUDA but no GPU is visible (CUDA_VISIBLE_DEVICES? driver?)")
    return info


def format_report(info: dict) -> str:
    def v(x):
        return x if x is not None else "not installed"

    lines = [
        f"python              {info['python']}",
        f"torch               {info['torch']} (CUDA {info['torch_cuda'] or 'none: CPU build'})",
        f"cuDNN / NCCL        {info['cudnn'] or '-'} / {info['nccl'] or '-'}",
        f"megatron-core       {v(info['megatron_core'])}",
        f"transformer-engine  {v(info['transformer_engine'])}",
        f"flash-attn          {v(info['flash_attn'])}",
        f"triton              {v(info['triton'])}",
    ]
    if not info["gpus"]:
        lines.append("GPUs                none visible: CPU/gloo path (the tiny preset, tests, demos)")
    for g in info["gpus"]:
        te = ", ".join(g["te_recipes"]) or ("none (no Transformer Engine)" if g["te_recipes_with_te_installed"]
                                             else "none on this generation")
        lines += [
            f"GPU {g['index']}               {g['name']}: sm_{g['capability'].replace('.', '')} "
            f"{g['generation']}, {g['memory_gib']} GiB, bf16 {'yes' if g['bf16'] else 'no'}",
            f"  TE recipes        {te}",
            f"  ours              --moe-expert-precision {'|'.join(g['moe_expert_precision'])} (emulated, "
            f"bit-exact; Triton quantizers {'yes' if g['triton_quantizers'] else 'no: torch reference'})",
        ]
    lines += [f"WARNING: {w}" for w in info["warnings"]]
    lines += [f"PROBLEM: {p}" for p in info["problems"]]
    lines.append("status              " + ("ok" if not info["problems"] else "problems found"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_composer.platform.doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    info = report()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 1 if info["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
