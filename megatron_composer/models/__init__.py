from .builder import build_model, transformer_config
from .forward import composer_forward
from .loading import checkpoint_model_config, load_checkpoint_model

__all__ = ["build_model", "checkpoint_model_config", "composer_forward", "load_checkpoint_model", "transformer_config"]
