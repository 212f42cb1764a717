"""Run config: schema (dataclasses with documented fields) and loading (YAML, overrides, errors)."""

from toolkit.config.load import apply_override, dump_config, load_config, validate
from toolkit.config.schema import RunConfig

__all__ = ["RunConfig", "apply_override", "dump_config", "load_config", "validate"]
