"""A pydantic base that rejects unknown keys with a did-you-mean, and file loading for JSON/YAML.

Every config section of the project derives from :class:`StrictModel`, so a typo such as
``"promt_len"`` fails at load time with ``unknown key 'promt_len' (did you mean 'prompt_len'?)``
instead of being silently ignored — the same policy as DeepSpeed's own config.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

ModelT = TypeVar("ModelT", bound="StrictModel")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field, its value and what is allowed."""


class StrictModel(BaseModel):
    """Base for all config sections: unknown keys are errors, fields are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @classmethod
    def parse(cls: type[ModelT], data: Any, *, where: str = "config") -> ModelT:
        """Validate ``data`` (a mapping) into this model; errors become one readable :class:`ConfigError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(explain_validation_error(cls, err, where)) from None


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names (and aliases) of the (nested) model that holds the location ``loc``."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):  # an index into a list of models: the models' fields follow
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = field.annotation
        args = getattr(current, "__args__", ())
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    if not (isinstance(current, type) and issubclass(current, BaseModel)):
        return []
    names = list(current.model_fields)
    names += [f.alias for f in current.model_fields.values() if f.alias]
    return names


def explain_validation_error(model: type[BaseModel], err: ValidationError, where: str) -> str:
    """One readable message for a pydantic error of ``model``: each field, its value, and did-you-mean for unknown keys."""
    lines = []
    for item in err.errors():
        loc = tuple(item.get("loc", ()))
        dotted = ".".join(str(p) for p in loc) or "<root>"
        if item.get("type") == "extra_forbidden":
            key = str(loc[-1]) if loc else "?"
            near = difflib.get_close_matches(key, _known_fields(model, loc), n=1, cutoff=0.6)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            allowed = ", ".join(sorted(_known_fields(model, loc)))
            lines.append(f"unknown key '{dotted}'{hint}; allowed keys here: {allowed}")
        else:
            value = item.get("input")
            lines.append(f"{dotted} = {value!r}: {item.get('msg')}")
    return f"invalid {where}:\n  " + "\n  ".join(lines)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML file into a dict (YAML needs pyyaml)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def load_model(path: str | Path, model: type[ModelT]) -> ModelT:
    """Load and validate a config file into ``model``."""
    return model.parse(load_mapping(path), where=f"config {str(path)!r}")
