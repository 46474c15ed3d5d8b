from .model import (
    ModelConfig,
    ParamEntry,
    ParameterCount,
    YarnConfig,
    count_parameters,
    model_config_from_dict,
    parameter_inventory,
)
from .presets import PRESETS, get_preset
from .stages import STAGES, Stage, get_stage, stage_seq_length
from .training import CheckpointConfig, MoEPrecisionConfig, OptimizerConfig, TrainingConfig

__all__ = [
    "CheckpointConfig",
    "ModelConfig",
    "MoEPrecisionConfig",
    "OptimizerConfig",
    "PRESETS",
    "ParamEntry",
    "ParameterCount",
    "STAGES",
    "Stage",
    "TrainingConfig",
    "YarnConfig",
    "count_parameters",
    "get_preset",
    "get_stage",
    "model_config_from_dict",
    "parameter_inventory",
    "stage_seq_length",
]
