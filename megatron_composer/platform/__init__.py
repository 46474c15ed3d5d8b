"""Device and distributed bootstrap: one code path for CPU/gloo and CUDA/NCCL."""
from .cpu import MegatronCoreVersionError, apply_cpu_shims, check_megatron_core_version
from .distributed import DistEnv, destroy_distributed, init_distributed, local_device

__all__ = [
    "DistEnv",
    "MegatronCoreVersionError",
    "apply_cpu_shims",
    "check_megatron_core_version",
    "destroy_distributed",
    "init_distributed",
    "local_device",
]
