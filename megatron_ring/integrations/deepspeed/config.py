"""DeepSpeed's part of a config: split off our ``megatron_ring`` section, validate the rest with DeepSpeed.

An inference config is DeepSpeed's inference JSON plus our ``megatron_ring`` section
(:mod:`megatron_ring.inference.schema`). DeepSpeed rejects unknown keys, so :func:`split_config`
takes our section off and :func:`check_deepspeed_config` validates the rest with DeepSpeed's own
schema (did-you-mean included) before anything is started; its ``dtype`` must be one a model runs
in (:data:`megatron_ring.config.gpt.DTYPES`, or DeepSpeed's aliases of them).
"""
from __future__ import annotations

import copy
import difflib
import inspect
from typing import Any

import torch

from megatron_ring.config.gpt import DTYPES
from megatron_ring.config.strict import ConfigError, Problems, explain_validation_error

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


def check_deepspeed_config(ds: dict[str, Any]) -> Any:
    """Validate DeepSpeed's part with ``DeepSpeedInferenceConfig``; ConfigError with every problem.

    Unknown keys get a did-you-mean; a ``dtype`` outside fp32/bf16/fp16 (and DeepSpeed's aliases
    of them, e.g. ``float32``) is rejected with the allowed values. Absent, DeepSpeed takes fp16.
    """
    from deepspeed.inference.config import DeepSpeedInferenceConfig, DtypeEnum
    from pydantic import ValidationError

    problems = Problems(where="DeepSpeed's inference keys")
    aliases = {m.name: [v for v in m.value[1:] if v != m.name] for m in DtypeEnum if m.name in DTYPES}
    accepted = [v for name, values in aliases.items() for v in (name, *values)]
    if "dtype" in ds and ds["dtype"] not in accepted:
        allowed = "; ".join(f"{name!r} (or {', '.join(repr(v) for v in values)})" for name, values in aliases.items())
        problems.add(f"dtype = {ds['dtype']!r}: allowed: {allowed}")
        ds = {k: v for k, v in ds.items() if k != "dtype"}  # DeepSpeed checks the other keys
    cfg = None
    try:
        cfg = DeepSpeedInferenceConfig(**ds)
    except ValidationError as err:
        for line in explain_validation_error(DeepSpeedInferenceConfig, err):
            problems.add(line)
    problems.raise_if_any()
    return cfg


def dtype_name(dtype: torch.dtype) -> str:
    """DeepSpeed's name (``"fp32"``, ``"bf16"``, ``"fp16"``) of a dtype its ``dtype`` key selected."""
    from deepspeed.inference.config import DtypeEnum

    return next(member.name for member in DtypeEnum if member.value[0] == dtype)


def torch_dtype(ds: dict[str, Any]) -> torch.dtype:
    """The compute dtype DeepSpeed's ``dtype`` key names (``fp32``, ``bf16``, ``fp16``, ...)."""
    return check_deepspeed_config(ds).dtype


# --- training -----------------------------------------------------------------------------------

ADAM_ENGINE_KEYS = frozenset({"torch_adam", "adam_w_mode", "fp32_optimizer_states"})
"""Keys of ``optimizer.params`` the engine takes itself for adam/adamw before building the optimizer."""


class _OneRank:
    """The mpu DeepSpeedConfig asks for the data-parallel size: 1, as the batch keys it is given are per rank."""

    @staticmethod
    def get_data_parallel_world_size() -> int:
        return 1


def check_deepspeed_training(ds: dict[str, Any], *, micro_batch: int, grad_accum: int) -> None:
    """DeepSpeed's own parser on DeepSpeed's part of a training config, and what its engine checks
    only once the model is built; ConfigError with every problem.

    Needs no process group: the batch keys (checked against dp by the training schema) are handed
    over in their one-rank form, ``train_batch_size = micro_batch * grad_accum``. Beyond
    ``DeepSpeedConfig``: the optimizer type by the engine's
    rule (one of DeepSpeed's optimizers, any case, or a ``torch.optim`` class; did-you-mean), and
    its params against the constructor the engine would call (:func:`_optimizer_class`).
    """
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    problems = Problems(where="DeepSpeed's training keys")
    ds = {**ds, "train_batch_size": micro_batch * grad_accum, "train_micro_batch_size_per_gpu": micro_batch,
          "gradient_accumulation_steps": grad_accum}
    try:
        cfg = DeepSpeedConfig(copy.deepcopy(ds), mpu=_OneRank())
    except ValidationError as err:
        for line in _explain_section_error(err):
            problems.add(line)
        problems.raise_if_any()
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError, DeepSpeedConfigError) as err:
        problems.add(f"DeepSpeedConfig rejects them: {err}")
        problems.raise_if_any()
    if cfg.optimizer_name is not None:
        _check_optimizer(cfg, problems)
    problems.raise_if_any()


SECTION_OF_MODEL = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedActivationCheckpointingConfig":
                    "activation_checkpointing", "DeepSpeedFlopsProfilerConfig": "flops_profiler",
                    "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16"}
"""The config key of each DeepSpeed section model (DeepSpeedConfig validates a section at a time)."""


def _explain_section_error(err: Any) -> list[str]:
    """The lines of a ValidationError of one of DeepSpeed's section models: the full key (under its section,
    e.g. ``zero_optimization.stagee``), the value and the rule; an unknown key gets a did-you-mean."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    models, found = [DeepSpeedConfigModel], None
    while models and found is None:  # the model named by the error's title, among DeepSpeed's section models
        model = models.pop()
        found = model if model.__name__ == err.title else None
        models.extend(model.__subclasses__())
    if found is None:
        return [f"{err.title}: {'.'.join(str(p) for p in item['loc'])} = {item.get('input')!r}: {item['msg']}"
                for item in err.errors()]
    return explain_validation_error(found, err, key=SECTION_OF_MODEL.get(err.title, ""))


TRAINER_FILLS = "auto"
"""The value a transformers ``Trainer`` replaces by its own argument (batch sizes, learning rate, ...)."""


def _without_auto(node: Any) -> Any:
    """``node`` without the entries whose value is :data:`TRAINER_FILLS` (at any depth)."""
    if isinstance(node, dict):
        return {k: _without_auto(v) for k, v in node.items() if v != TRAINER_FILLS}
    return node


def check_trainer_config(ds: dict[str, Any], where: str) -> int:
    """A DeepSpeed config for the transformers ``Trainer`` (``TrainingArguments(deepspeed=...)``, no
    ``megatron_ring`` section): DeepSpeed's own parser and the ZeRO-3 rules of
    :func:`~megatron_ring.integrations.deepspeed.zero3.zero3_problems`, before any rank. ``"auto"``
    entries are the Trainer's to fill, so they are left to DeepSpeed's defaults here (a batch key
    given as a number is checked as given). ConfigError with every problem, named ``where``; the ZeRO stage."""
    from megatron_ring.integrations.deepspeed.zero3 import zero3_problems, zero_stage

    concrete = _without_auto(ds)
    micro = concrete.get("train_micro_batch_size_per_gpu", 1)
    accum = concrete.get("gradient_accumulation_steps", 1)
    problems = Problems(where=where)
    problems.run(check_deepspeed_training, concrete, micro_batch=micro if isinstance(micro, int) else 1,
                 grad_accum=accum if isinstance(accum, int) else 1)
    for problem in zero3_problems(concrete, cp=1):
        problems.add(problem)
    problems.raise_if_any()
    return zero_stage(concrete)


def _check_optimizer(cfg: Any, problems: Problems) -> None:
    """``optimizer.type`` and ``optimizer.params`` as the engine will use them (see :func:`check_deepspeed_training`)."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name, params = cfg.optimizer_name, cfg.optimizer_params or {}
    if not isinstance(params, dict):
        problems.add(f"optimizer.params = {params!r}: must be a mapping of the optimizer's arguments")
        return
    params = dict(params)
    torch_optimizers = [n for n in dir(torch.optim) if n != "Optimizer" and isinstance(getattr(torch.optim, n), type)
                        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)]
    # The engine's rule (DeepSpeedEngine._is_supported_optimizer, applied once the model is built);
    # DeepSpeedConfig has lower-cased DeepSpeed's own names. Lower-case torch names are modules, not classes.
    if name not in DEEPSPEED_OPTIMIZERS and name not in torch_optimizers:
        known = {n.lower(): n for n in [*DEEPSPEED_OPTIMIZERS, *torch_optimizers]}  # torch's spelling wins
        near = difflib.get_close_matches(str(name).lower(), list(known), n=1, cutoff=0.6)
        hint = f" (did you mean {known[near[0]]!r}?)" if near else ""
        problems.add(f"optimizer.type = {name!r}: not an optimizer DeepSpeed knows{hint}; allowed: "
                     f"{', '.join(DEEPSPEED_OPTIMIZERS)} (any case) or a torch.optim class "
                     f"({', '.join(torch_optimizers)})")
        return
    if "max_grad_norm" in params:
        problems.add(f"optimizer.params.max_grad_norm = {params.pop('max_grad_norm')!r}: DeepSpeed refuses it; "
                     "use the top-level gradient_clipping")
    offload = cfg.zero_config.offload_optimizer
    cpu_offload = offload is not None and offload.device in ("cpu", "nvme")
    if name == "muon":
        _check_params(params, "deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam", _muon_params(), takes_any=False,
                      engine_keys=ADAM_ENGINE_KEYS | {"foreach"}, problems=problems, show_defaults=False)
        return
    try:
        cls = _optimizer_class(name, params, cpu_offload=cpu_offload)
    except ImportError as err:
        problems.add(f"optimizer.type = {name!r}: DeepSpeed builds it from a package that is not installed ({err})")
        return
    signature = inspect.signature(cls.__init__).parameters
    defaults = {n: p.default for n, p in signature.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in ("self", "params", "model_params")}
    _check_params(params, f"{cls.__module__}.{cls.__name__}", defaults,
                  takes_any=any(p.kind == p.VAR_KEYWORD for p in signature.values()),
                  engine_keys=ADAM_ENGINE_KEYS if name in ("adam", "adamw") else frozenset(), problems=problems)


def _check_params(params: dict[str, Any], owner: str, defaults: dict[str, Any], *, takes_any: bool,
                  engine_keys: frozenset[str], problems: Problems, show_defaults: bool = True) -> None:
    """Each of ``params`` against the argument of that name (its default gives the kind), unknown names
    with a did-you-mean unless ``takes_any``; ``engine_keys`` are the engine's own, not the optimizer's."""
    for key, value in params.items():
        if key in engine_keys:
            continue
        if key in defaults:
            if not _same_kind(value, defaults[key]):
                default = f" (default {defaults[key]!r})" if show_defaults else ""
                problems.add(f"optimizer.params.{key} = {value!r}: {owner.rsplit('.', 1)[-1]} takes "
                             f"{_kind(defaults[key])}{default}")
        elif not takes_any:
            names = sorted(set(defaults) | engine_keys)
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.add(f"optimizer.params.{key}: unknown to {owner}{hint}; allowed: {', '.join(names)}")


def _muon_params() -> dict[str, Any]:
    """The ``optimizer.params`` DeepSpeed's engine reads for ``"muon"``, each with a value of its kind (not
    its default): each half of a parameter group (Muon's, and the auxiliary Adam's) takes the keys the
    engine lists for it, ``muon_lr`` / ``adam_lr`` override the shared ``lr``; the engine drops any other
    key unread."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    kinds: dict[str, Any] = {"betas": (0.0, 0.0), "ns_method": None}
    keys = {*DeepSpeedEngine._MUON_HALF_KEYS, *DeepSpeedEngine._ADAM_HALF_KEYS, "muon_lr", "adam_lr"}
    return {key: kinds.get(key, 0.0) for key in sorted(keys)}


def _optimizer_class(name: str, params: dict[str, Any], *, cpu_offload: bool) -> type:
    """The class ``DeepSpeedEngine._configure_basic_optimizer`` builds for ``name`` and ``params``
    (``"muon"`` aside: :func:`_muon_params`); ImportError when it comes from a package not installed."""
    if name in ("adam", "adamw"):
        if params.get("torch_adam", False):
            return torch.optim.AdamW if name == "adamw" or params.get("adam_w_mode", True) else torch.optim.Adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        return DeepSpeedCPUAdam if cpu_offload else FusedAdam
    if name == "adagrad":
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad if cpu_offload else torch.optim.Adagrad
    if name == "lamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb
    if name == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        return DeepSpeedCPULion if cpu_offload else FusedLion
    if name in ("muadam", "muadamw", "musgd"):
        import mup

        return {"muadam": mup.MuAdam, "muadamw": mup.MuAdamW, "musgd": mup.MuSGD}[name]
    return getattr(torch.optim, name)


def _same_kind(value: Any, default: Any) -> bool:
    """Whether ``value`` is of the kind of a constructor default: a number, a bool, or a tuple of numbers."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, tuple) and all(isinstance(d, (int, float)) for d in default):
        return isinstance(value, (list, tuple)) and len(value) == len(default) and all(
            _same_kind(v, d) for v, d in zip(value, default))
    return True


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, tuple):
        return f"a list of {len(default)} numbers"
    return "a number"
