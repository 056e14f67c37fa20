"""Typed, validated run configuration: dataclasses filled from YAML and `a.b=c` overrides."""

from hpctrain.config.load import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
    with_overrides,
)
from hpctrain.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    SlurmConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "SlurmConfig",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "with_overrides",
]
