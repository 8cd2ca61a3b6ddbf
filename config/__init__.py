"""Typed pipeline configuration: the YAML file that drives every stage (and DVC's params file)."""

from config.load import ConfigError, load_config
from config.schema import PipelineConfig

__all__ = ["ConfigError", "PipelineConfig", "load_config"]
