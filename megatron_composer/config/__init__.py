from .model import ModelConfig, ParameterCount, YarnConfig, count_parameters
from .presets import PRESETS, get_preset

__all__ = ["ModelConfig", "ParameterCount", "YarnConfig", "count_parameters", "PRESETS", "get_preset"]
