from .model import ModelConfig, ParameterCount, YarnConfig, count_parameters, model_config_from_dict
from .presets import PRESETS, get_preset
from .stages import STAGES, Stage, get_stage, stage_seq_length
from .training import CheckpointConfig, MoEPrecisionConfig, OptimizerConfig, TrainingConfig

__all__ = [
    "CheckpointConfig",
    "ModelConfig",
    "MoEPrecisionConfig",
    "OptimizerConfig",
    "PRESETS",
    "ParameterCount",
    "STAGES",
    "Stage",
    "TrainingConfig",
    "YarnConfig",
    "count_parameters",
    "get_preset",
    "get_stage",
    "model_config_from_dict",
    "stage_seq_length",
]
