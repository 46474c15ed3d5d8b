"""Check a machine before a run: `python -m megatron_composer.platform.doctor [--json]`.

Prints the facts that decide what a run can use, and whether each version is
one megatron-composer runs with (`platform.versions`):

* Python, torch and the CUDA / cuDNN / NCCL it was built with (torch's CUDA
  version decides TE's block-scaled FP8), and the torch features the code
  picks up when present (`torch._grouped_mm`, `torch.nn.attention.varlen`);
* megatron-core; Transformer Engine, imported for real: a TE whose shared
  libraries do not load raises OSError, which megatron-core's
  `except ImportError` does not catch, so every run would die at import;
* Triton and the host C compiler it builds its launcher with at the first
  kernel launch (`CC`, else gcc, else clang on PATH, Triton's own order):
  megatron's fused YaRN RoPE, compiled losses and our quantizers need both;
* every visible GPU with its compute capability and generation, the TE FP8 /
  FP4 recipes that run there (`platform.recipes.available_recipes`: the
  generation, torch's CUDA version and TE's version) and, for each recipe
  the generation has but this install does not, what it lacks;
* our own `--moe-expert-precision nvfp4|mxfp8` (the bit-exact emulation),
  which runs anywhere, with Triton quantizers on CUDA when Triton imports.

Exit status 1 when something a run needs is missing or refused; warnings
(an accepted but untested version, no TE on a GPU) do not fail it.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import sys
from typing import Optional

from .versions import (
    installed_version,
    megatron_core_verdict,
    torch_verdict,
    transformer_engine_verdict,
)


def _import_failure(module: str) -> Optional[str]:
    """None when `module` imports, else the exception as "Type: message" (any type: a
    broken CUDA extension raises OSError or RuntimeError, not ImportError)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - what failed is the report
        return f"{type(e).__name__}: {e}"
    return None


def c_compiler(environ=None) -> dict:
    """The host C compiler Triton would build with: `CC` if set, else gcc, else clang on PATH.
    Returns {"compiler": path or None, "source": "CC" | "PATH" | None, "problem": text or None}."""
    environ = os.environ if environ is None else environ
    cc = environ.get("CC")
    if cc:
        path = shutil.which(cc.split()[0], path=environ.get("PATH"))
        problem = None if path else f"CC={cc!r} is not an executable on PATH"
        return {"compiler": path or cc, "source": "CC", "problem": problem}
    for name in ("gcc", "clang"):
        path = shutil.which(name, path=environ.get("PATH"))
        if path:
            return {"compiler": path, "source": "PATH", "problem": None}
    return {"compiler": None, "source": None,
            "problem": "no C compiler (CC unset, no gcc or clang on PATH)"}


def _version(distribution: str, module: str) -> Optional[str]:
    """Installed version of a package, or None when it does not import (for any reason)."""
    if _import_failure(module) is not None:
        return None
    return installed_version(distribution) or getattr(sys.modules[module], "__version__", "unknown")


def _transformer_engine() -> dict:
    """Transformer Engine's version (None: not installed) and, when it is installed,
    the error `import transformer_engine.pytorch` raises (None: it imports)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return {"version": None, "import_error": None}
    error = _import_failure("transformer_engine.pytorch")
    version = installed_version("transformer-engine") or installed_version("transformer-engine-torch")
    if version is None:
        version = getattr(sys.modules.get("transformer_engine"), "__version__", "unknown")
    return {"version": version, "import_error": error}


def _torch_facts(torch) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "torch_grouped_mm": hasattr(torch, "_grouped_mm"),
        "torch_varlen_attn": _import_failure("torch.nn.attention.varlen") is None,
        "cuda_available": cuda,
    }


def _gpus(torch, te: dict, triton: Optional[str]) -> list[dict]:
    from .recipes import available_recipes, generation, recipe_blockers

    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        cap = (props.major, props.minor)
        runs = available_recipes(cap, torch.version.cuda, te["version"])
        usable_te = te["version"] is not None and te["import_error"] is None
        gpus.append({
            "index": i, "name": props.name, "capability": f"{cap[0]}.{cap[1]}",
            "generation": generation(cap), "memory_gib": round(props.total_memory / 2**30, 1),
            "bf16": torch.cuda.is_bf16_supported(),
            "te_recipes": runs if usable_te else [],
            "te_recipes_with_te_installed": runs,
            "te_recipes_blocked": recipe_blockers(cap, torch.version.cuda, te["version"]),
            "moe_expert_precision": ["bf16", "mxfp8", "nvfp4"],
            "triton_quantizers": triton is not None,
        })
    return gpus


def judge(info: dict) -> None:
    """Fill info["problems"] and info["warnings"] from the facts."""
    problems, warnings = info["problems"], info["warnings"]
    cuda = info["cuda_available"]
    verdicts = [torch_verdict(info["torch"], cuda), transformer_engine_verdict(info["transformer_engine"])]
    if info["megatron_core_import_error"]:  # installed but broken: say why rather than "install it"
        problems.append(f"megatron-core does not import ({info['megatron_core_import_error']})")
    else:
        verdicts.insert(1, megatron_core_verdict(info["megatron_core"], cuda))
    for verdict in verdicts:
        if not verdict.ok:
            problems.append(verdict.note)
        elif verdict.note:
            warnings.append(verdict.note)
    if info["transformer_engine_import_error"]:
        problems.append(f"transformer-engine {info['transformer_engine']} is installed but does not import "
                        f"({info['transformer_engine_import_error']}); megatron-core catches only ImportError, "
                        f"so every run fails at import: reinstall TE for this torch and CUDA "
                        f"(pip install -e '.[gpu]') or uninstall it (--transformer-impl local)")
    elif cuda and info["transformer_engine"] is None:
        warnings.append("Transformer Engine not installed: --transformer-impl defaults to local, "
                        "no TE FP8/FP4 recipes (pip install -e '.[gpu]' or an NGC PyTorch container)")
    compiler = info["c_compiler"]
    if compiler["problem"] and info["triton"] is not None:
        text = (f"{compiler['problem']}: Triton builds its launcher with a host C compiler at the first "
                f"kernel launch (megatron's fused YaRN RoPE, compiled losses, our quantizers); "
                f"apt-get install gcc, or set CC")
        (problems if cuda else warnings).append(text)
    if info["torch_cuda"] and not cuda:
        warnings.append("torch was built with CUDA but no GPU is visible (CUDA_VISIBLE_DEVICES? driver?)")


def report() -> dict:
    """Everything the doctor prints, as a dict (see `--json`)."""
    import torch

    info = {"python": platform.python_version(), **_torch_facts(torch)}
    te = _transformer_engine()
    triton = _version("triton", "triton")
    info.update({
        "megatron_core": _version("megatron-core", "megatron.core"),
        "megatron_core_import_error": (_import_failure("megatron.core")
                                       if importlib.util.find_spec("megatron") is not None else None),
        "transformer_engine": te["version"],
        "transformer_engine_import_error": te["import_error"],
        "flash_attn": _version("flash-attn", "flash_attn"),
        "triton": triton,
        "c_compiler": c_compiler(),
        "gpus": _gpus(torch, te, triton),
        "problems": [],
        "warnings": [],
    })
    judge(info)
    return info


def _format_gpu(g: dict) -> list[str]:
    te = ", ".join(g["te_recipes"]) or ("none (no usable Transformer Engine)" if g["te_recipes_with_te_installed"]
                                         else "none on this install")
    lines = [
        f"GPU {g['index']}               {g['name']}: sm_{g['capability'].replace('.', '')} "
        f"{g['generation']}, {g['memory_gib']} GiB, bf16 {'yes' if g['bf16'] else 'no'}",
        f"  TE recipes        {te}",
    ]
    lines += [f"  not {name:<14} needs {need}" for name, need in g["te_recipes_blocked"].items()]
    lines.append(f"  ours              --moe-expert-precision {'|'.join(g['moe_expert_precision'])} (emulated, "
                 f"bit-exact; Triton quantizers {'yes' if g['triton_quantizers'] else 'no: torch reference'})")
    return lines


def format_report(info: dict) -> str:
    def v(x):
        return x if x is not None else "not installed"

    te = v(info["transformer_engine"])
    if info["transformer_engine_import_error"]:
        te += f" (does not import: {info['transformer_engine_import_error']})"
    compiler = info["c_compiler"]
    cc = compiler["problem"] or f"{compiler['compiler']}" + (" (CC)" if compiler["source"] == "CC" else "")
    features = [name for name, key in (("torch._grouped_mm", "torch_grouped_mm"),
                                       ("varlen_attn", "torch_varlen_attn")) if info[key]]
    lines = [
        f"python              {info['python']}",
        f"torch               {info['torch']} (CUDA {info['torch_cuda'] or 'none: CPU build'}; "
        f"{', '.join(features) or 'neither torch._grouped_mm nor varlen_attn'})",
        f"cuDNN / NCCL        {info['cudnn'] or '-'} / {info['nccl'] or '-'}",
        f"megatron-core       {v(info['megatron_core'])}",
        f"transformer-engine  {te}",
        f"flash-attn          {v(info['flash_attn'])}",
        f"triton              {v(info['triton'])}",
        f"C compiler          {cc}",
    ]
    if not info["gpus"]:
        lines.append("GPUs                none visible: CPU/gloo path (the tiny preset, tests, demos)")
    for g in info["gpus"]:
        lines += _format_gpu(g)
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
