"""Config: dataclass schema, YAML + dotted overrides (OmegaConf struct mode), one validation pass."""

from .load import ConfigError, load_config, save_config, to_yaml
from .schema import Config
from .validate import data_parallel_size, validate

__all__ = ["Config", "ConfigError", "data_parallel_size", "load_config", "save_config", "to_yaml", "validate"]
