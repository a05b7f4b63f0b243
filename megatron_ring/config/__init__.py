"""Validated configuration schemas (pydantic) shared by the CLI, launchers and integrations."""
from megatron_ring.config.strict import ConfigError, StrictModel, load_mapping, load_model

__all__ = ["ConfigError", "StrictModel", "load_mapping", "load_model"]
