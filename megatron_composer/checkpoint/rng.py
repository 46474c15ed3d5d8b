"""The random state one rank saves in its `rng_rank{r}.pt`, and how it is restored.

Format 2 (a dict of tensors, ints and strings; `torch.load(weights_only=True)`):

    format            2
    device            "cuda" or "cpu": where the run that saved it computed
    torch             the CPU default generator
    cuda              the default generator of this rank's GPU (CUDA runs only)
    cuda_rng_tracker  {name: state} of megatron-core's RNG tracker
                      (`tensor_parallel.get_cuda_rng_tracker()`: the
                      model-parallel and expert-parallel streams dropout and
                      initialization fork from)

Format 1 (files without "format"): {"torch", optionally "cuda": the states
of every visible GPU}; it still loads, and its tracker streams keep their
seeded state.

On CPU `platform.cpu` makes the CPU generator play the CUDA one, so the
tracker's states are CPU generator states there and CUDA Philox states on a
GPU: the two do not convert. A checkpoint saved on one kind of device and
loaded on the other restores the CPU generator and keeps the freshly seeded
device streams, and `restore_rng_state` says so in the note it returns
(the run continues, not bit-exact with an uninterrupted one).
"""
from __future__ import annotations

from typing import Optional

import torch

FORMAT = 2


def _device_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _tracker():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _as_tensor(state) -> torch.Tensor:
    # a cudagraph-safe tracker keeps generators; their state is the same ByteTensor
    return state.get_state() if isinstance(state, torch.Generator) else state.clone()


def rng_state() -> dict:
    """This rank's random state in format 2 (see the module docstring)."""
    state = {"format": FORMAT, "device": _device_kind(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    state["cuda_rng_tracker"] = {name: _as_tensor(s) for name, s in _tracker().get_states().items()}
    return state


def _saved_device(saved: dict) -> str:
    if "device" in saved:
        return saved["device"]
    return "cuda" if "cuda" in saved else "cpu"  # format 1 wrote "cuda" exactly on CUDA runs


def _restore_cuda_default(saved_cuda) -> None:
    if isinstance(saved_cuda, (list, tuple)):  # format 1: every visible GPU; ours is the current one
        index = torch.cuda.current_device()
        if index >= len(saved_cuda):
            return
        saved_cuda = saved_cuda[index]
    torch.cuda.set_rng_state(saved_cuda)


def _restore_tracker(saved: dict[str, torch.Tensor]) -> Optional[str]:
    tracker = _tracker()
    current = tracker.get_states()
    if set(saved) != set(current):
        return (f"the checkpoint's RNG tracker streams {sorted(saved)} differ from this run's "
                f"{sorted(current)}; they keep their seeded state")
    tracker.set_states({name: state.clone() for name, state in saved.items()})
    return None


def restore_rng_state(saved: dict) -> Optional[str]:
    """Restore `saved` (format 1 or 2) into this process; return a note when part of it
    could not be restored (saved on another kind of device, other tracker streams), else None."""
    fmt = int(saved.get("format", 1))
    if fmt > FORMAT:
        raise ValueError(f"rng state format {fmt} is newer than this version reads ({FORMAT}); "
                         "resume with the version that wrote the checkpoint")
    torch.set_rng_state(saved["torch"])
    kind, now = _saved_device(saved), _device_kind()
    if kind != now:
        return (f"the random state was saved on {kind} and this run is on {now}: the CPU generator is "
                f"restored, the {now} generator and megatron's RNG tracker streams keep their seeded "
                "state (training continues, not bit-exact with an uninterrupted run)")
    if kind == "cuda" and "cuda" in saved:
        _restore_cuda_default(saved["cuda"])
    if "cuda_rng_tracker" in saved:
        return _restore_tracker(saved["cuda_rng_tracker"])
    return None
