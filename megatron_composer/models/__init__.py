from .builder import build_model, transformer_config
from .forward import composer_forward

__all__ = ["build_model", "composer_forward", "transformer_config"]
