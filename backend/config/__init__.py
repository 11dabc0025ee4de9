"""Config: dataclass schema, YAML + dotted overrides (OmegaConf struct mode), one validation pass."""

from .errors import ConfigError
from .load import load_config, save_config, to_yaml
from .paths import checkpoint_dir
from .schema import Config
from .validate import validate

__all__ = ["Config", "checkpoint_dir", "ConfigError", "load_config", "save_config", "to_yaml", "validate"]
