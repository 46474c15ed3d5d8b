"""Distributed bootstrap for `torchrun`, Slurm `srun` and a single process.

Rank discovery, in order:
1. torchrun / torch elastic: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.
2. Slurm (one task per GPU via `srun`): SLURM_PROCID, SLURM_NTASKS,
   SLURM_LOCALID; the master address is the first host of
   SLURM_JOB_NODELIST (or MASTER_ADDR if set), port MASTER_PORT or 29500.
3. Neither: a single process (rank 0 of 1) with an in-memory store (no port).

The backend is NCCL when CUDA is available and gloo otherwise. With CUDA,
each process selects GPU LOCAL_RANK (`torch.cuda.set_device`) before anything
touches CUDA, so NCCL communicators and megatron-core's buffers
(`torch.cuda.current_device()`) land on it; `local_device()` is where the
trainer puts the model and the batches. On CPU the megatron-core shims of
`platform.cpu` are applied before any model is built; on every device the
fixes of `platform.compat` for megatron-core without Transformer Engine.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .compat import apply_library_fixes
from .cpu import apply_cpu_shims
from .versions import check_megatron_core_version


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if torch.cuda.is_available() else "gloo"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as `gpu[003-005,007],cpu01`."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    match = re.match(r"^([^\[]+)\[([^\]]+)\]", first)
    if not match:
        return first
    prefix, ranges = match.groups()
    start = ranges.split(",")[0].split("-")[0]
    return prefix + start


def _int_env(env, name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def discover_env(env=None) -> DistEnv:
    """Work out rank, world size and rendezvous address from the environment."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=_int_env(env, "RANK"),
            world_size=_int_env(env, "WORLD_SIZE"),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        return DistEnv(
            rank=_int_env(env, "SLURM_PROCID"),
            world_size=_int_env(env, "SLURM_NTASKS"),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(nodelist),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="slurm",
        )
    return DistEnv(0, 1, 0, "127.0.0.1", 0, "single")


def local_device() -> torch.device:
    """This process's device: its GPU (selected by `init_distributed`), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _select_gpu(local_rank: int) -> None:
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"LOCAL_RANK {local_rank} but this node shows {count} GPUs "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                         f"launch at most {count} processes per node")
    torch.cuda.set_device(local_rank)


def init_distributed(timeout_minutes: int = 30) -> DistEnv:
    """Initialize torch.distributed (once) and the device; return the environment.

    Safe to call when a process group already exists (tests, notebooks).
    """
    env = discover_env()
    if env.rank >= env.world_size or env.rank < 0:
        raise ValueError(f"rank {env.rank} is outside world size {env.world_size}")
    if not torch.cuda.is_available():
        apply_cpu_shims()
    else:
        check_megatron_core_version(on_cuda=True)  # on CPU apply_cpu_shims checks it
        _select_gpu(env.local_rank)
    apply_library_fixes()
    if not dist.is_initialized() and env.launcher == "single":
        # One process needs no rendezvous: an in-memory store, no port to race for.
        dist.init_process_group(
            backend=env.backend, store=dist.HashStore(), rank=0, world_size=1,
            timeout=timedelta(minutes=timeout_minutes),
        )
    elif not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(
            backend=env.backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(minutes=timeout_minutes),
        )
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=env.local_rank,
        master_addr=env.master_addr,
        master_port=env.master_port,
        launcher=env.launcher,
    )


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
