"""Which Transformer Engine low-precision recipes a GPU generation runs.

The recipe names are those of the command line: `--fp8-recipe tensorwise`
is "fp8-tensorwise", `--fp4-recipe nvfp4` is "fp4-nvfp4". The table follows
Transformer Engine's datatype / hardware support matrix, by CUDA compute
capability:

    capability                      fp8-tensorwise  fp8-blockwise  fp8-mxfp8  fp4-nvfp4
    < 8.9   (Ampere and older)      -               -              -          -
    8.9     (Ada: L4, L40S)         yes             -              -          -
    9.x     (Hopper: H100, H200)    yes             yes            -          -
    10.x    (Blackwell: B200, B300) yes             yes            yes        yes
    11.x / 12.x (Blackwell: RTX)    yes             yes            -          -

MXFP8 and NVFP4 need the block-scaled tensor cores of data-center Blackwell;
TE lists MXFP8 as unsupported and NVFP4 as partial on compute capability 12,
so neither is offered there. Our own `--moe-expert-precision nvfp4 / mxfp8`
(an exact emulation, `quant/`) runs everywhere and is not in this table.

The GPU is not all: Transformer Engine also checks the CUDA version torch
was built with (`torch.version.cuda`; TE's `check_fp8_block_scaling_support`
and `check_fp8_support`), and its own version matters once:

    recipe           also needs
    fp8-blockwise    CUDA 12.9 or newer (TE's block-scaled FP8 GEMM);
                     on compute capability 10 and up, TE 2.9 or newer (older TE: Hopper only)
    fp8-tensorwise   on Ada (8.9), CUDA 12.1 or newer

`available_recipes` is a pure function of the capability, the CUDA version
and the TE version; `check_recipe` raises a ValueError that names what is
missing (the generation, or the CUDA version) and what would work;
`check_recipe_on_this_gpu` reads those facts from the running process.
"""
from __future__ import annotations

from typing import Optional

RECIPES = ("fp8-tensorwise", "fp8-blockwise", "fp8-mxfp8", "fp4-nvfp4")
BLOCKWISE_CUDA = "12.9"  # TE's block-scaled FP8 GEMM
BLOCKWISE_BEYOND_HOPPER_TE = "2.9"  # older TE runs fp8-blockwise on Hopper only
ADA_FP8_CUDA = "12.1"
_NEEDS = {
    "fp8-tensorwise": "Ada (compute capability 8.9) or newer",
    "fp8-blockwise": "Hopper (compute capability 9.0) or newer",
    "fp8-mxfp8": "data-center Blackwell (compute capability 10.x)",
    "fp4-nvfp4": "data-center Blackwell (compute capability 10.x)",
}


_GENERATIONS = {
    (7, 0): "Volta", (7, 2): "Volta", (7, 5): "Turing",
    (8, 0): "Ampere", (8, 6): "Ampere", (8, 7): "Ampere", (8, 9): "Ada",
    (9, 0): "Hopper",
    (10, 0): "Blackwell", (10, 1): "Blackwell", (10, 3): "Blackwell Ultra",
    (11, 0): "Blackwell (Thor)", (12, 0): "Blackwell (GeForce / RTX PRO)", (12, 1): "Blackwell (GB10)",
}


def generation(capability: tuple[int, int]) -> str:
    """NVIDIA architecture name of a CUDA compute capability, e.g. (9, 0) -> "Hopper"."""
    capability = tuple(capability)
    if capability in _GENERATIONS:
        return _GENERATIONS[capability]
    major = capability[0]
    family = {7: "Volta/Turing", 8: "Ampere/Ada", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}.get(major)
    return f"{family or 'unknown'} (sm_{capability[0]}{capability[1]})"


def _by_generation(capability: tuple[int, int]) -> list[str]:
    major, minor = capability
    if (major, minor) < (8, 9):
        return []
    if major == 8:
        return ["fp8-tensorwise"]
    if major == 10:
        return list(RECIPES)
    return ["fp8-tensorwise", "fp8-blockwise"]


def _major_minor(version: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of "12.9", "2.11.0+cu13", "2.9.0.dev0"; None for None or an unreadable string."""
    try:
        major, minor = str(version).split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or "x")
    except ValueError:
        return None


def _missing(name: str, capability: tuple[int, int], cuda: Optional[str],
             te: Optional[str]) -> Optional[tuple[str, str]]:
    """(what recipe `name` still needs from the CUDA or TE version, how to get it), or None when
    nothing is missing; the GPU generation is `_by_generation`'s business."""
    cuda_version = _major_minor(cuda)
    built = f"this torch is built with CUDA {cuda}" if cuda else "this torch is a CPU build"

    def cuda_below(minimum: str) -> bool:
        return cuda_version is None or cuda_version < _major_minor(minimum)

    if name == "fp8-blockwise" and cuda_below(BLOCKWISE_CUDA):
        return (f"CUDA {BLOCKWISE_CUDA} or newer (Transformer Engine's block-scaled FP8 GEMM); {built}",
                f"install a torch and Transformer Engine built for CUDA {BLOCKWISE_CUDA} or newer (the cu129 / "
                f"cu130 wheels, or an NGC PyTorch container with CUDA >= {BLOCKWISE_CUDA})")
    te_version = _major_minor(te)
    if (name == "fp8-blockwise" and capability[0] >= 10 and te_version is not None
            and te_version < _major_minor(BLOCKWISE_BEYOND_HOPPER_TE)):
        return (f"Transformer Engine {BLOCKWISE_BEYOND_HOPPER_TE} or newer beyond Hopper; "
                f"transformer-engine {te} is installed", "pip install -e '.[gpu]'")
    if name == "fp8-tensorwise" and capability < (9, 0) and cuda_below(ADA_FP8_CUDA):
        return (f"CUDA {ADA_FP8_CUDA} or newer on Ada; {built}",
                f"install a torch and Transformer Engine built for CUDA {ADA_FP8_CUDA} or newer")
    return None


def available_recipes(capability: tuple[int, int], cuda: Optional[str], te: Optional[str] = None) -> list[str]:
    """TE recipe names (see `RECIPES`) that run on compute capability `capability` with torch
    built for CUDA `cuda` (`torch.version.cuda`; None: a CPU build) and transformer-engine
    `te` (None: not known; taken as one the `[gpu]` extra installs)."""
    capability = tuple(capability)
    return [name for name in _by_generation(capability) if _missing(name, capability, cuda, te) is None]


def recipe_blockers(capability: tuple[int, int], cuda: Optional[str], te: Optional[str] = None) -> dict[str, str]:
    """{recipe: what it needs} for the recipes this generation runs but the CUDA or TE version blocks."""
    capability = tuple(capability)
    blocked = {name: _missing(name, capability, cuda, te) for name in _by_generation(capability)}
    return {name: missing[0] for name, missing in blocked.items() if missing is not None}


def recipe_name(fp8_recipe: Optional[str] = None, fp4_recipe: Optional[str] = None) -> Optional[str]:
    """The table's name for `--fp8-recipe` / `--fp4-recipe` values (None: no TE recipe)."""
    if fp8_recipe is not None and fp4_recipe is not None:
        raise ValueError(f"--fp8-recipe {fp8_recipe} and --fp4-recipe {fp4_recipe} are exclusive; choose one")
    if fp8_recipe is not None:
        return f"fp8-{fp8_recipe}"
    if fp4_recipe is not None:
        return f"fp4-{fp4_recipe}"
    return None


def check_recipe(name: str, capability: tuple[int, int], cuda: Optional[str], device_name: str = "this GPU",
                 te: Optional[str] = None) -> None:
    """Raise a ValueError if recipe `name` does not run on `capability` with CUDA `cuda` and TE `te`."""
    if name not in RECIPES:
        raise ValueError(f"unknown TE recipe {name!r}; one of {', '.join(RECIPES)}")
    capability = tuple(capability)
    fits = available_recipes(capability, cuda, te)
    if name in fits:
        return
    flag = "--{}-recipe {}".format(*name.split("-", 1))  # "fp8-mxfp8" -> "--fp8-recipe mxfp8"
    works = ", ".join(fits) if fits else "none (bf16 only)"
    where = (f"{device_name} is {generation(capability)} (compute capability {capability[0]}.{capability[1]}), "
             f"where these TE recipes run: {works}")
    emulated = "--moe-expert-precision nvfp4/mxfp8 (exact emulation) runs on any GPU"
    missing = _missing(name, capability, cuda, te) if name in _by_generation(capability) else None
    if missing is not None:
        need, fix = missing
        raise ValueError(f"{flag} needs {need}. {where}. To run {flag}, {fix}; or {emulated}")
    raise ValueError(f"{flag} needs {_NEEDS[name]}; {where}. {emulated}")


def check_recipe_on_this_gpu(name: str) -> None:
    """`check_recipe` with the current GPU, torch's CUDA version and the installed TE."""
    import torch

    from .versions import installed_version

    check_recipe(name, torch.cuda.get_device_capability(), torch.version.cuda, torch.cuda.get_device_name(),
                 te=installed_version("transformer-engine") or installed_version("transformer_engine"))
