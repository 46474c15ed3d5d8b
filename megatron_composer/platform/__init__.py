"""Device and distributed bootstrap: one code path for CPU/gloo and CUDA/NCCL."""
from .cpu import apply_cpu_shims
from .distributed import DistEnv, destroy_distributed, init_distributed, local_device
from .versions import MegatronCoreVersionError, check_megatron_core_version

__all__ = [
    "DistEnv",
    "MegatronCoreVersionError",
    "apply_cpu_shims",
    "check_megatron_core_version",
    "destroy_distributed",
    "init_distributed",
    "local_device",
]
