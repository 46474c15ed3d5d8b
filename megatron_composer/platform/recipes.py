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

`available_recipes` is a pure function of the capability; `check_recipe`
raises a ValueError that names the generation and what would work.
"""
from __future__ import annotations

from typing import Optional

RECIPES = ("fp8-tensorwise", "fp8-blockwise", "fp8-mxfp8", "fp4-nvfp4")
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


def available_recipes(capability: tuple[int, int]) -> list[str]:
    """TE recipe names (see `RECIPES`) that run on compute capability `capability`."""
    major, minor = capability
    if (major, minor) < (8, 9):
        return []
    if major == 8:
        return ["fp8-tensorwise"]
    if major == 10:
        return list(RECIPES)
    return ["fp8-tensorwise", "fp8-blockwise"]


def recipe_name(fp8_recipe: Optional[str] = None, fp4_recipe: Optional[str] = None) -> Optional[str]:
    """The table's name for `--fp8-recipe` / `--fp4-recipe` values (None: no TE recipe)."""
    if fp8_recipe is not None and fp4_recipe is not None:
        raise ValueError(f"--fp8-recipe {fp8_recipe} and --fp4-recipe {fp4_recipe} are exclusive; choose one")
    if fp8_recipe is not None:
        return f"fp8-{fp8_recipe}"
    if fp4_recipe is not None:
        return f"fp4-{fp4_recipe}"
    return None


def check_recipe(name: str, capability: tuple[int, int], device_name: str = "this GPU") -> None:
    """Raise a ValueError if recipe `name` does not run on `capability`."""
    if name not in RECIPES:
        raise ValueError(f"unknown TE recipe {name!r}; one of {', '.join(RECIPES)}")
    fits = available_recipes(capability)
    if name in fits:
        return
    flag = "--{}-recipe {}".format(*name.split("-", 1))  # "fp8-mxfp8" -> "--fp8-recipe mxfp8"
    works = ", ".join(fits) if fits else "none (bf16 only)"
    raise ValueError(
        f"{flag} needs {_NEEDS[name]}; {device_name} is {generation(capability)} (compute capability "
        f"{capability[0]}.{capability[1]}), where these TE recipes run: {works}. "
        f"--moe-expert-precision nvfp4/mxfp8 (exact emulation) runs on any GPU")
