"""DeepSpeed's part of a config: split off our ``megatron_ring`` section, validate the rest with DeepSpeed.

An inference config is DeepSpeed's inference JSON plus our ``megatron_ring`` section
(:mod:`megatron_ring.inference.schema`). DeepSpeed rejects unknown keys, so :func:`split_config`
takes our section off and :func:`check_deepspeed_config` validates the rest with DeepSpeed's own
schema (did-you-mean included) before anything is started.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_ring.config.strict import ConfigError, explain_validation_error

SECTION = "megatron_ring"
"""The key of our section in a DeepSpeed inference config."""


def split_config(raw: dict[str, Any], *, where: str = "config") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(deepspeed_part, megatron_ring_section)`` of a full config mapping; the input is not changed."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    if SECTION not in raw:
        raise ConfigError(f"{where} has no '{SECTION}' section; keys present: {sorted(raw)}")
    rest = {k: v for k, v in raw.items() if k != SECTION}
    return rest, raw[SECTION]


def check_deepspeed_config(ds: dict[str, Any], *, where: str = "config") -> Any:
    """Validate DeepSpeed's part with ``DeepSpeedInferenceConfig``; ConfigError with did-you-mean."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from pydantic import ValidationError

    try:
        return DeepSpeedInferenceConfig(**ds)
    except ValidationError as err:
        raise ConfigError(explain_validation_error(DeepSpeedInferenceConfig, err, f"DeepSpeed inference keys of {where}")) from None


def torch_dtype(ds: dict[str, Any]) -> torch.dtype:
    """The compute dtype DeepSpeed's ``dtype`` key names (``fp32``, ``bf16``, ``fp16``, ...)."""
    return check_deepspeed_config(ds).dtype
