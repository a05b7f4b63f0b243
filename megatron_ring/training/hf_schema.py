"""The ``transformers`` entry of a training config: which transformers causal LM to train.

In the ``megatron_ring`` section, instead of ``model`` (a ``configs/megatron`` YAML)::

    "transformers": {
      "config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, ...},
      "attention": "ring"
    }

``config`` builds a randomly initialised model (seeded by ``megatron_ring.seed``) from the
arguments of ``transformers.AutoConfig.for_model``; ``path`` loads a local checkpoint folder
(``config.json`` and weights; nothing is downloaded). :func:`transformers_config` checks it before
anything is started: the model type and every config key (did-you-mean against the defaults of
that model type's config class, which would otherwise keep a misspelt key as a silent attribute),
the attention against the layout, and the vocabulary against the byte-level tokenizer.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field

from megatron_ring.config import ConfigError, StrictModel
from megatron_ring.parallel.layout import ParallelLayout

FIELD = "megatron_ring.transformers"
"""Where the section sits in a training config (for error messages)."""
SECTION_LAYOUT = "megatron_ring.layout"

MIN_VOCAB = 128
"""The byte-level tokenizer of ``data.kind = 'text'`` needs ASCII + end of document."""


class TransformersModelSection(StrictModel):
    """A transformers causal LM: a random one from ``config``, or a local checkpoint at ``path``."""

    config: Optional[dict[str, Any]] = Field(None, description="arguments of transformers.AutoConfig.for_model, "
                                             "model_type included: a randomly initialised model")
    path: Optional[str] = Field(None, description="a local checkpoint folder (relative to the config file)")
    attention: Literal["ring", "sdpa", "eager"] = Field("ring", description="attn_implementation; cp > 1 needs ring")


def transformers_config(section: TransformersModelSection, path: Optional[Path], layout: ParallelLayout,
                        data_kind: str) -> Any:
    """The ``transformers.PretrainedConfig`` of ``section`` (``path``: its ``path`` resolved, if given);
    ConfigError naming the field, its value and what is allowed."""
    problems = []
    if (section.config is None) == (section.path is None):
        raise ConfigError(f"{FIELD}: give exactly one of 'config' (a random model) and 'path' (a local checkpoint)")
    if layout.tp != 1:
        problems.append(f"{SECTION_LAYOUT}.tp = {layout.tp}: a transformers model trains with tp = 1 "
                        "(context and data parallel); allowed: 1")
    if layout.cp > 1 and section.attention != "ring":
        problems.append(f"{FIELD}.attention = {section.attention!r} with layout.cp = {layout.cp}: only 'ring' "
                        "attends across the context-parallel ranks; allowed: 'ring' (or cp = 1)")
    config = _from_path(path) if section.config is None else _from_arguments(section.config)
    if data_kind == "text" and config.vocab_size < MIN_VOCAB:
        problems.append(f"{FIELD} vocab_size = {config.vocab_size}: the byte-level tokenizer of data.kind = 'text' "
                        f"needs at least {MIN_VOCAB} ids (ASCII + end of document)")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"{FIELD} attention_dropout = {config.attention_dropout}: ring attention trains without "
                        "attention dropout; allowed: 0.0")
    if problems:
        raise ConfigError(*problems)
    return config


def _from_arguments(arguments: dict[str, Any]) -> Any:
    """``AutoConfig.for_model(**arguments)`` after checking the model type and every key."""
    from transformers import CONFIG_MAPPING

    model_type = arguments.get("model_type")
    if model_type not in CONFIG_MAPPING:
        near = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{FIELD}.config.model_type = {model_type!r}: not a transformers model type{hint}; "
                          "allowed: a key of transformers.CONFIG_MAPPING, e.g. 'llama', 'qwen2', 'mistral'")
    config_class = CONFIG_MAPPING[model_type]
    known = set(config_class().to_dict())
    unknown = [key for key in arguments if key not in known]
    if unknown:
        raise ConfigError(*(
            f"{FIELD}.config.{key}: unknown to {config_class.__name__}"
            + (f" (did you mean {near[0]!r}?)" if (near := difflib.get_close_matches(key, sorted(known), n=1)) else "")
            for key in unknown))
    try:
        return config_class(**{k: v for k, v in arguments.items() if k != "model_type"})
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{FIELD}.config: {config_class.__name__} rejects it: {err}") from None


def _from_path(path: Optional[Path]) -> Any:
    """The config of a local checkpoint folder (``config.json``; never downloaded)."""
    from transformers import AutoConfig

    if path is None or not (path / "config.json").is_file():
        raise ConfigError(f"{FIELD}.path = {str(path)!r} is not a checkpoint folder (no config.json); allowed: a "
                          "local folder saved by save_pretrained")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{FIELD}.path = {str(path)!r}: transformers cannot read its config: {err}") from None
