"""A pydantic base that rejects unknown keys and coercions, a collector of problems, and file loading.

Every config section of the project derives from :class:`StrictModel`, so a typo such as
``"promt_len"`` fails at load time with ``unknown key 'promt_len' (did you mean 'prompt_len'?)``
instead of being silently ignored — the same policy as DeepSpeed's own config. Types are strict:
``"batch": true`` or ``"prompt_len": "48"`` are errors, not 1 and 48 (an integer where a float
is expected is fine), and so are NaN and infinities in any float field. Checks between fields
collect into :class:`Problems`, so one :class:`ConfigError` reports every reason at once.
:func:`load_mapping` reads JSON or YAML, names the file, line and column of a syntax error and
refuses a key given twice in one mapping (both parsers would silently keep the last);
:func:`check_writable` tries an output location before any work is done. :data:`TimeoutSeconds`
is the type of every timeout field: finite, positive, at most :data:`MAX_TIMEOUT_S`.
"""
from __future__ import annotations

import difflib
import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ModelT = TypeVar("ModelT", bound="StrictModel")
T = TypeVar("T")

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest timeout a config may give (one week); Python's ``timedelta`` overflows far above it."""
TimeoutSeconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]
"""A timeout in seconds: finite, > 0 and at most :data:`MAX_TIMEOUT_S`."""


class ConfigError(ValueError):
    """A configuration that cannot be used; each problem names the field, its value and what is allowed.

    ``problems`` holds every reason (one entry each); ``where`` (the file or section) heads the message.
    """

    def __init__(self, *problems: str, where: Optional[str] = None) -> None:
        super().__init__(*problems)
        self.problems = list(problems)
        self.where = where

    def __str__(self) -> str:
        if self.where is None and len(self.problems) == 1:
            return self.problems[0]
        count = f" ({len(self.problems)} problems)" if len(self.problems) > 1 else ""
        lines = ("  " + p.replace("\n", "\n    ") for p in self.problems)
        return f"invalid {self.where or 'config'}{count}:\n" + "\n".join(lines)

    def located(self) -> list[str]:
        """The problems, each prefixed with ``where`` when set: entries of a larger report."""
        return [f"{self.where}: {p}" if self.where else p for p in self.problems]


class Problems:
    """Collects the problems of a config so that one :class:`ConfigError` names them all.

    Checks that raise :class:`ConfigError` run through :meth:`run`: their problems are recorded
    and the next check runs. :meth:`raise_if_any` raises them together.
    """

    def __init__(self, where: Optional[str] = None) -> None:
        self.where = where
        self.found: list[str] = []

    def add(self, problem: str) -> None:
        self.found.append(problem)

    def run(self, check: Callable[..., T], *args: Any, **kwargs: Any) -> Optional[T]:
        """``check(*args, **kwargs)``, or None (its problems recorded) when it raises :class:`ConfigError`
        (prefixed with its ``where`` unless that is this collection's own)."""
        try:
            return check(*args, **kwargs)
        except ConfigError as err:
            self.found.extend(err.problems if err.where == self.where else err.located())
            return None

    def raise_if_any(self) -> None:
        if self.found:
            raise ConfigError(*self.found, where=self.where)


class StrictModel(BaseModel):
    """Base for all config sections: unknown keys, coercions (bool or str for a number, float for
    an int) and NaN or infinite floats are errors; fields are validated on assignment."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, frozen=False,
                              allow_inf_nan=False)

    @classmethod
    def parse(cls: type[ModelT], data: Any, *, where: Optional[str] = "config", key: str = "") -> ModelT:
        """Validate ``data`` (a mapping) into this model; errors become one :class:`ConfigError`.

        ``key``: the dotted key of this section in its file (``"megatron_ring"``), put in front of
        every field the errors name; ``where`` heads the message (None: the caller adds it).
        """
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(*explain_validation_error(cls, err, key=key), where=where) from None


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


def explain_validation_error(model: type[BaseModel], err: ValidationError, *, key: str = "") -> list[str]:
    """One line per error of ``model``: the field (under ``key``), its value and the rule; unknown
    keys get a did-you-mean and the allowed keys."""
    lines = []
    for item in err.errors():
        loc = tuple(item.get("loc", ()))
        dotted = ".".join(str(p) for p in (key, *loc) if p != "") or "<root>"
        if item.get("type") == "extra_forbidden":
            name = str(loc[-1]) if loc else "?"
            known = _known_fields(model, loc)
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            lines.append(f"unknown key '{dotted}'{hint}; allowed keys here: {', '.join(sorted(known))}")
        elif item.get("type") == "missing":  # its input is the enclosing mapping: not worth printing
            lines.append(f"{dotted}: missing; this key is required")
        else:
            lines.append(f"{dotted} = {item.get('input')!r}: {item.get('msg')}")
    return lines


class _DuplicateKey(Exception):
    """A mapping of a config file gives ``key`` twice (at ``line``, when known)."""

    def __init__(self, key: Any, line: Optional[int] = None) -> None:
        super().__init__(key)
        self.key, self.line = key, line


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: a dict, or :class:`_DuplicateKey`."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _yaml_loader() -> type:
    """PyYAML's SafeLoader refusing a key given twice in one mapping (:class:`_DuplicateKey`)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML file into a dict (YAML needs pyyaml); a syntax error is a
    :class:`ConfigError` naming the file, the line and the column, a key given twice in one mapping
    one naming the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass
        except _DuplicateKey as err:
            raise ConfigError(_duplicate(path, err)) from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            problem = getattr(err, "problem", None) or str(err)
            raise ConfigError(_syntax_error(path, "YAML", problem, text, mark.line + 1 if mark else None,
                                            mark.column + 1 if mark else None)) from None
    else:
        try:
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        except _DuplicateKey as err:
            raise ConfigError(_duplicate(path, err)) from None
        except json.JSONDecodeError as err:
            raise ConfigError(_syntax_error(path, "JSON", err.msg, text, err.lineno, err.colno)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def _duplicate(path: Path, err: _DuplicateKey) -> str:
    where = f" (line {err.line})" if err.line else ""
    return (f"config file {str(path)!r} gives the key {err.key!r} twice in one mapping{where}; "
            "keep one (the parser would silently use the last)")


def _syntax_error(path: Path, kind: str, problem: str, text: str, line: Optional[int], column: Optional[int]) -> str:
    """``config file 'x.json' is not valid JSON: <problem> at line L, column C`` and the line itself."""
    if line is None:
        return f"config file {str(path)!r} is not valid {kind}: {problem}"
    lines = text.splitlines()
    shown = lines[line - 1] if 0 < line <= len(lines) else ""
    return (f"config file {str(path)!r} is not valid {kind}: {problem} at line {line}, column {column}\n"
            f"{shown}\n{' ' * ((column or 1) - 1)}^")


def check_writable(path: Path, *, field: str, value: str, directory: bool = False) -> None:
    """ConfigError naming ``field`` and ``value`` unless a file can be written at ``path`` (with
    ``directory``: inside the directory ``path``).

    Creates the missing directories (the run would create them too), then creates and removes a
    temporary file there, so an unwritable location fails before any work instead of at the end.
    """
    folder = path if directory else path.parent
    if not directory and path.is_dir():
        raise ConfigError(f"{field} = {value!r}: {str(path)!r} is a directory; give the path of a file")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{field} = {value!r}: {str(existing)!r} is a file, not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".megatron_ring_write_check.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise ConfigError(f"{field} = {value!r}: cannot write in {str(folder)!r} "
                          f"({err.strerror or err}); choose a writable location") from None


def output_problem(outputs: dict[str, tuple[str | Path | None, bool]]) -> str | None:
    """The first of ``{flag: (path, is_directory)}`` (None paths skipped) that cannot be written, as
    :func:`check_writable`'s message, or None: a CLI checks its outputs before any work."""
    for flag, (value, directory) in outputs.items():
        if value is not None:
            try:
                check_writable(Path(value), field=flag, value=str(value), directory=directory)
            except ConfigError as err:
                return str(err)
    return None


def load_model(path: str | Path, model: type[ModelT]) -> ModelT:
    """Load and validate a config file into ``model``."""
    return model.parse(load_mapping(path), where=f"config {str(path)!r}")
