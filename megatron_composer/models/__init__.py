from .builder import ParallelSizes, build_model, transformer_config
from .forward import composer_forward, unwrap

__all__ = ["ParallelSizes", "build_model", "composer_forward", "transformer_config", "unwrap"]
