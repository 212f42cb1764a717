"""Configs: schemas with documented fields (RL in schema.py, SFT and RM in stages.py, shared sections in
base.py and data.py), loading (YAML, overrides, errors by line) and pipelines of stages."""

from toolkit.config.load import apply_override, dump_config, load_config, validate
from toolkit.config.schema import RunConfig
from toolkit.config.stages import RMConfig, SFTConfig

__all__ = ["RMConfig", "RunConfig", "SFTConfig", "apply_override", "dump_config", "load_config", "validate"]
