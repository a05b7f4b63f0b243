"""Schema of a training config: DeepSpeed's training JSON plus our ``megatron_ring`` section.

A config for ``launch/train.py`` is one JSON file::

    {
      "train_batch_size": 4,                       <- DeepSpeed's keys: batch, optimizer, ZeRO, dtype
      "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 1,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": true}},
      "zero_optimization": {"stage": 1},
      "megatron_ring": {                           <- ours, validated here
        "model": "../megatron/tiny_ring_cp2.yaml",
        "layout": {"tp": 1, "pp": 1, "cp": 2, "dp": 2},
        "seq_len": 64,
        "steps": 40,
        "data": {"kind": "text", "paths": ["../../docs", "../../README.md"]},
        "checkpoint": {"dir": "runs/train_cp2/ckpt", "save_interval": 20},
        "log": {"jsonl": "runs/train_cp2/train.jsonl"}
      }
    }

:func:`load_train_spec` checks everything that can be checked without a process group or a
model, so a bad config stops every rank before anything is built, with every problem in one
error: unknown keys in our section (did-you-mean) and strict types, unknown top-level DeepSpeed
keys (did-you-mean against DeepSpeed's own key names), the layout against the launched world
size (a ``seq_len`` that is not a multiple of ``2 * cp`` is padded, never rejected), ``train_batch_size =
train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp``, the model YAML with the
layout and sequence length written into it (heads divisible by tp, ...), its dtype against
DeepSpeed's, the data paths and the corpus length (one sample of ``seq_len + 1`` tokens at least),
for ``data.kind`` documents / chat the data itself through the checkpoint's tokenizer (each error
naming the file, line and field: :func:`document_problems`),
attention dropout (0 with RingAttention), the checkpoint directory and the log file (written to and removed),
and DeepSpeed's part with DeepSpeed's own parser plus what its engine would reject only once the
model is built (optimizer type and params:
:func:`megatron_ring.integrations.deepspeed.config.check_deepspeed_training`; ZeRO-3's
``reduce_scatter`` at cp > 1, prescaling, NVMe without async I/O: :func:`megatron_ring.integrations.deepspeed.zero3.zero3_problems`).
A ``transformers`` entry instead of ``model`` is checked by :mod:`megatron_ring.training.hf_schema`. Each error names
the field, its value and what is allowed. Importing this module needs pydantic only; validating
imports DeepSpeed.
"""
from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field

from megatron_ring.config import ConfigError, Problems, StrictModel, TimeoutSeconds, check_writable, load_mapping
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.config.gpt import GPTConfig
from megatron_ring.config.layout import LayoutConfig
from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.training.megatron_args import is_megatron_args
from megatron_ring.training.megatron_section import MegatronSection
from megatron_ring.training.hf_schema import TransformersModelSection, transformers_config

SECTION = "megatron_ring"
DOCUMENT_KINDS = ("documents", "chat")
"""``data.kind`` values read through a checkpoint's tokenizer (:mod:`megatron_ring.training.tokenized`)."""
"""Key of our section in the DeepSpeed training JSON."""

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""DeepSpeed's batch keys: global batch = micro batch x gradient accumulation x dp (sequences)."""

DEEPSPEED_TRAINING_KEYS: frozenset[str] = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "optimizer", "scheduler", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "fp16", "bf16", "amp", "torch_autocast", "data_types", "communication_data_type",
    "seq_parallel_communication_data_type", "wall_clock_breakdown", "memory_breakdown", "dump_state",
    "activation_checkpointing", "checkpoint", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "compile", "aio", "autotuning", "elasticity", "curriculum_learning", "data_efficiency",
    "pipeline", "sparse_attention", "dataloader_drop_last", "disable_allgather", "zero_legacy_stage1",
    "graph_harvesting", "use_data_before_expert_parallel_", "use_node_local_storage", "load_universal_checkpoint",
    "timers", "weight_quantization", "compression_training", "nebula", "hybrid_engine", "eigenvalue",
    "progressive_layer_drop", "quantize_training", "gradient_accumulation_dtype", "expert_parallel",
    "tensor_parallel", "sequence_parallel_size",
})
"""Top-level keys of a DeepSpeed training config that we pass through (DeepSpeed itself ignores
unknown top-level keys, so a typo such as ``gradient_clip`` would be silently dropped)."""



class DataSection(StrictModel):
    """Where training tokens come from.

    ``kind: text`` reads ``paths`` (files, or folders searched recursively for ``suffixes``), in
    sorted order, through the byte-level tokenizer; ``kind: synthetic`` draws uniform random
    tokens from ``seed`` (explicitly opted into, never a silent fallback). ``kind: documents``
    (text files) and ``kind: chat`` (JSONL conversations, loss on assistant tokens) tokenize with a
    checkpoint's own tokenizer: ``tokenizer`` or else the model's checkpoint
    (:mod:`megatron_ring.training.tokenized`), and pack whole documents into rows, each attending
    only within itself (Note [Packed training rows] in :mod:`megatron_ring.training.data`).
    """

    kind: Literal["text", "synthetic", "documents", "chat"] = "text"
    paths: list[str] = Field(default_factory=list, description="text files or folders (relative to the config file)")
    suffixes: Optional[list[str]] = Field(None, description="file endings searched for in folders; default "
                                          "['.md', '.txt', '.py', '.rst'], for kind: chat ['.jsonl']")
    tokenizer: Optional[CheckpointSource] = Field(None, description="kinds documents/chat: the checkpoint whose "
                                                  "tokenizer reads the data; default: the model's checkpoint")
    packing: bool = Field(True, description="kinds documents/chat: several documents per row (each attending "
                          "only within itself); false: one document per row")
    shuffle: bool = True
    seed: int = 1234
    synthetic_samples: int = Field(4096, ge=1, description="number of distinct sequences for kind: synthetic")

    def held_out(self, section: "EvalSection") -> "DataSection":
        """This section reading ``section``'s held-out files instead, in order (not shuffled)."""
        return self.model_copy(update={"paths": section.paths, "suffixes": section.suffixes or self.suffixes,
                                       "shuffle": False})

    def file_suffixes(self) -> list[str]:
        """``suffixes``, or the default of the kind."""
        if self.suffixes is not None:
            return self.suffixes
        return [".jsonl"] if self.kind == "chat" else [".md", ".txt", ".py", ".rst"]


class EvalSection(StrictModel):
    """Held-out loss (Megatron's ``eval_interval``, the ``Trainer``'s ``eval_steps``): the mean token loss
    over every row of held-out files, read like ``data`` (its kind, tokenizer, packing), at the start,
    every ``interval`` steps and after the last step; rank 0 logs ``{"event": "eval", ...}`` lines."""

    paths: list[str] = Field(..., min_length=1, description="held-out files or folders (relative to the config file)")
    suffixes: Optional[list[str]] = Field(None, description="file endings searched for in folders; default: data's")
    interval: int = Field(0, ge=0, description="evaluate every interval steps; 0: at the start and the end only")


class CheckpointSection(StrictModel):
    """DeepSpeed checkpoints: every ``save_interval`` steps (0: only at the end) and at the last step."""

    dir: Optional[str] = Field(None, description="checkpoint directory; None: no checkpoints")
    save_interval: int = Field(0, ge=0)
    resume: bool = Field(True, description="continue from the latest complete checkpoint in dir, if any")
    overwrite: bool = Field(False, description="with resume: false, delete dir's checkpoints before the first step "
                            "(without it, resume: false into a folder holding checkpoints is refused)")


class LogSection(StrictModel):
    """Per-step metrics: a JSON line per step (rank 0, flushed) and a progress bar on rank 0."""

    jsonl: Optional[str] = Field(None, description="path of the JSON-lines log; None: no file")
    progress: bool = True


class TrainSection(StrictModel):
    """Our ``megatron_ring`` section of a training config."""

    name: str = "train"
    engine: Literal["deepspeed", "megatron"] = Field("deepspeed", description="deepspeed: DeepSpeed's engine "
                                                     "(ZeRO, pp = 1); megatron: Megatron-core's DDP, optimizer, "
                                                     "pipeline schedules and dist_checkpointing")
    megatron: Optional[MegatronSection] = Field(None, description="engine: megatron's optimizer, ddp, scheduler, "
                                                "recompute, virtual_pipeline")
    model: Optional[str] = Field(None, description="path of a configs/megatron YAML (relative to this config file, "
                                                   "then to the working directory)")
    transformers: Optional[TransformersModelSection] = Field(
        None, description="a transformers causal LM instead of model (training/hf_schema.py)")
    attention: Optional[Literal["local", "sdpa", "ring"]] = Field(None, description="override the model file's attention")
    layout: LayoutConfig = Field(default_factory=LayoutConfig)
    seq_len: int = Field(..., ge=2, description="tokens per sequence (global, before CP sharding; any length: "
                         "padded for zigzag); kinds documents/chat: the most input tokens of a packed row")
    steps: int = Field(..., ge=1, description="optimizer steps of the whole run")
    data: DataSection = Field(default_factory=DataSection)
    eval: Optional[EvalSection] = Field(None, description="held-out loss during training; None: none")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    log: LogSection = Field(default_factory=LogSection)
    seed: int = 1234
    stop_on_nonfinite_loss: bool = Field(True, description="stop every rank (exit 4) at a NaN or infinite step "
                                         "loss; false trains on, never saving such a step as a checkpoint")
    collective_timeout_s: TimeoutSeconds = Field(300.0, description="timeout of every collective")
    peer_timeout_s: TimeoutSeconds = Field(120.0, description="a peer whose heartbeat stops this long is declared "
                                           "lost (a dead process on this host is seen at once)")


@dataclass(frozen=True)
class TrainSpec:
    """A validated training config: DeepSpeed's part, our section, the model and the layout."""

    deepspeed: dict[str, Any]
    train: TrainSection
    model: Optional[GPTConfig]
    layout: ParallelLayout
    micro_batch: int
    grad_accum: int
    global_batch: int
    base_dir: Path
    transformers: Optional[Any] = None
    """The ``transformers.PretrainedConfig`` when ``train.transformers`` is set (``model`` is then None)."""
    pretrained: Optional[Any] = None
    """The :class:`~megatron_ring.training.pretrained.PretrainedSource` when the model file names a checkpoint."""

    @property
    def vocab_size(self) -> int:
        return self.transformers.vocab_size if self.transformers is not None else self.model.model.vocab_size

    def path(self, value: str, *, existing: bool = False) -> Path:
        """A path of the config resolved against the config file's directory (absolute paths unchanged);
        with ``existing``, an input that exists only relative to the working directory is taken there."""
        return _resolve(value, self.base_dir, must_exist=existing)


def _resolve(value: str, base: Path, *, must_exist: bool) -> Path:
    """``value`` relative to ``base``, else to the working directory when only that exists."""
    path = Path(value)
    if path.is_absolute():
        return path
    if must_exist and not (base / path).exists() and path.exists():
        return path.resolve()
    return (base / path).resolve()


def check_batch(ds: dict[str, Any], dp: int) -> tuple[int, int, int]:
    """``(micro, grad_accum, global)`` from DeepSpeed's batch keys; ConfigError naming the keys.

    Like DeepSpeed, any two of the three keys determine the third (grad accumulation alone
    defaults to 1); all three must satisfy ``global = micro * grad_accum * dp``.
    """
    given = {k: ds.get(k) for k in BATCH_KEYS}
    bad = [f"{key} = {value!r}: must be a positive integer" for key, value in given.items()
           if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1)]
    if bad:
        raise ConfigError(*bad)
    glob, micro, accum = given["train_batch_size"], given["train_micro_batch_size_per_gpu"], \
        given["gradient_accumulation_steps"]
    if micro is None and glob is None:
        raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu (sequences per step / per rank)")
    if glob is None:
        accum = accum or 1
        glob = micro * accum * dp
    elif micro is None:
        accum = accum or 1
        if glob % (accum * dp):
            raise ConfigError(f"train_batch_size = {glob} is not divisible by gradient_accumulation_steps * dp = "
                              f"{accum} * {dp}; allowed: a multiple of {accum * dp}")
        micro = glob // (accum * dp)
    elif accum is None:
        if glob % (micro * dp):
            raise ConfigError(f"train_batch_size = {glob} is not divisible by train_micro_batch_size_per_gpu * dp = "
                              f"{micro} * {dp}; allowed: a multiple of {micro * dp}")
        accum = glob // (micro * dp)
    if glob != micro * accum * dp:
        raise ConfigError(
            f"train_batch_size = {glob} != train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp = "
            f"{micro} * {accum} * {dp} = {micro * accum * dp}; the global batch counts sequences over the "
            f"data-parallel ranks only (cp and tp ranks share a sequence)"
        )
    return micro, accum, glob


def deepspeed_dtype(ds: dict[str, Any]) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: the training dtype DeepSpeed's keys select."""
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled", False):
            return name
    return "fp32"


def check_deepspeed_keys(ds: dict[str, Any]) -> None:
    """ConfigError for every top-level key DeepSpeed would silently ignore (with a did-you-mean)."""
    problems = []
    for key in ds:
        if key not in DEEPSPEED_TRAINING_KEYS:
            near = difflib.get_close_matches(key, sorted(DEEPSPEED_TRAINING_KEYS | {SECTION}), n=1, cutoff=0.6)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            problems.append(f"unknown DeepSpeed key '{key}'{hint}; DeepSpeed would ignore it. Known keys: "
                            f"{', '.join(sorted(DEEPSPEED_TRAINING_KEYS))}")
    if problems:
        raise ConfigError(*problems)


def parse_train_spec(raw: dict[str, Any], *, world_size: int, base_dir: Path, where: str = "config") -> TrainSpec:
    """Validate a whole training config mapping for ``world_size`` processes (see module docstring);
    one :class:`ConfigError` names every problem found."""
    from megatron_ring.integrations.deepspeed.config import check_deepspeed_training
    from megatron_ring.integrations.deepspeed.zero3 import zero3_problems

    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    if SECTION not in raw:
        raise ConfigError(f"{where} has no '{SECTION}' section; keys present: {sorted(raw)}")
    problems = Problems(where=where)
    ds = {k: v for k, v in raw.items() if k != SECTION}
    problems.run(check_deepspeed_keys, ds)
    train = problems.run(TrainSection.parse, raw[SECTION], where=None, key=SECTION)
    if train is None:  # dp unknown: the batch keys wait; DeepSpeed checks the rest of its keys
        if not (isinstance(raw[SECTION], dict) and raw[SECTION].get("engine") == "megatron"):
            problems.run(check_deepspeed_training, ds, micro_batch=1, grad_accum=1)
        problems.raise_if_any()
    deepspeed_engine = train.engine == "deepspeed"
    for problem in engine_problems(train, ds):
        problems.add(problem)
    layout = train.layout.layout()
    if layout.world_size != world_size:
        problems.add(f"{SECTION}.layout = {layout.describe()} does not match the world size {world_size}; "
                     "the product tp*pp*cp*dp must equal the number of launched processes")
    batch = problems.run(check_batch, ds, layout.dp)
    micro, accum, glob = batch or (1, 1, layout.dp)  # rejected batch keys: 1 x 1 for DeepSpeed's other checks
    if deepspeed_engine:
        problems.run(check_deepspeed_training, ds, micro_batch=micro, grad_accum=accum)
        for zero3_problem in zero3_problems(ds, layout.cp):
            problems.add(zero3_problem)
    model = hf_config = pretrained = None
    if (train.model is None) == (train.transformers is None):
        problems.add(f"{SECTION}: give exactly one of 'model' (a configs/megatron YAML) and 'transformers' "
                     "(a transformers causal LM)")
    elif train.transformers is not None:
        if train.attention is not None:
            problems.add(f"{SECTION}.attention = {train.attention!r} overrides a configs/megatron model's attention; "
                         f"a transformers model takes {SECTION}.transformers.attention instead")
        if not deepspeed_engine:
            problems.add(f"{SECTION}.transformers trains under engine 'deepspeed' only; {SECTION}.engine = "
                         "'megatron' trains a configs/megatron model")
        hf_config = problems.run(transformers_config, train.transformers, base_dir, layout, train.data.kind)
        positions = getattr(hf_config, "max_position_embeddings", None)
        if isinstance(positions, int) and train.seq_len > positions:
            problems.add(f"{SECTION}.seq_len = {train.seq_len}: more than the transformers model's "
                         f"max_position_embeddings = {positions} (its position table would be indexed past the "
                         f"end); allowed: seq_len <= {positions}, or raise max_position_embeddings in "
                         f"{SECTION}.transformers.config")
    else:
        model, pretrained = problems.run(_model_config, train, base_dir, pad=True) or (None, None)
        if model is not None and model.parallel.sequence_parallel and deepspeed_engine:
            problems.add(f"sequence_parallel (model {train.model!r}, parallel.sequence_parallel) trains under "
                         f"{SECTION}.engine = 'megatron' only (its finalize_model_grads reduces the norms' gradients "
                         "over TP); allowed with engine 'deepspeed': false")
        if model is not None and model.parallel.sequence_parallel and train.data.kind in DOCUMENT_KINDS:
            problems.add(f"{SECTION}.data.kind = {train.data.kind!r} packs documents into rows of varying length, "
                         "which sequence_parallel would have to split over the TP ranks; allowed: sequence_parallel "
                         "false, or data.kind 'text' / 'synthetic'")
        if pretrained is not None and deepspeed_engine:
            problems.add(f"{SECTION}.model = {train.model!r} names a checkpoint: it trains under {SECTION}.engine = "
                         f"'megatron' (or give it as {SECTION}.transformers under engine 'deepspeed')")
    if model is not None and deepspeed_engine:
        problems.run(model.check_dtype, deepspeed_dtype(ds), source="DeepSpeed's bf16.enabled / fp16.enabled",
                     model=f"{SECTION}.model = {train.model!r}")
    if model is not None and train.megatron is not None and not deepspeed_engine:
        for problem in train.megatron.problems(model, grad_accum=accum, where=f"{SECTION}.megatron"):
            problems.add(problem)
    for problem in data_problems(train, base_dir, model, hf_config, pretrained):
        problems.add(problem)
    if train.eval is not None:
        for problem in eval_problems(train, base_dir, model, hf_config, pretrained):
            problems.add(problem)
    if model is not None and model.attention != "local" and model.model.attention_dropout > 0:
        problems.add(f"model.attention_dropout = {model.model.attention_dropout} in {train.model!r}: "
                     f"attention = {model.attention!r} (RingAttention) trains without attention dropout; "
                     "allowed: 0.0 (or attention: local at cp = 1)")
    if train.checkpoint.dir is not None:
        problems.run(check_writable, _resolve(train.checkpoint.dir, base_dir, must_exist=False),
                     field=f"{SECTION}.checkpoint.dir", value=train.checkpoint.dir, directory=True)
        if (problem := lineage_problem(train.checkpoint, _resolve(train.checkpoint.dir, base_dir, must_exist=False))):
            problems.add(problem)
    if train.log.jsonl is not None:
        problems.run(check_writable, _resolve(train.log.jsonl, base_dir, must_exist=False),
                     field=f"{SECTION}.log.jsonl", value=train.log.jsonl)
    problems.raise_if_any()
    return TrainSpec(deepspeed=ds, train=train, model=model, layout=layout, micro_batch=micro, grad_accum=accum,
                     global_batch=glob, base_dir=base_dir, transformers=hf_config, pretrained=pretrained)


def data_problems(train: TrainSection, base_dir: Path, model: Optional[GPTConfig], hf_config: Any,
                  pretrained: Any) -> list[str]:
    """What stops ``train.data``: paths, the corpus length (kind text), the documents through the tokenizer."""
    found: list[str] = []
    if train.data.kind == "text":
        if not train.data.paths:
            found.append(f"{SECTION}.data.paths is empty; give text files/folders or set data.kind = 'synthetic'")
        missing = [i for i, entry in enumerate(train.data.paths)
                   if not _resolve(entry, base_dir, must_exist=True).exists()]
        for i in missing:
            found.append(f"{SECTION}.data.paths[{i}] = {train.data.paths[i]!r} does not exist "
                         f"(relative paths start at {str(base_dir)!r})")
        if model is not None and model.model.vocab_size < 128:
            found.append(f"model.vocab_size = {model.model.vocab_size} in {train.model!r}: the byte-level "
                         "tokenizer of data.kind = 'text' needs at least 128 ids (ASCII + end of document)")
        if train.data.paths and not missing:
            found.extend(_located(check_corpus_length, train, base_dir))
    if train.data.kind in DOCUMENT_KINDS:
        found.extend(document_problems(train, base_dir, hf_config if model is None else model,
                                       pretrained.source if pretrained is not None else None))
    return found


def eval_problems(train: TrainSection, base_dir: Path, model: Optional[GPTConfig], hf_config: Any,
                  pretrained: Any) -> list[str]:
    """What stops ``train.eval``: :func:`data_problems` of the held-out files (named ``eval.paths``)."""
    if train.data.kind == "synthetic":
        return [f"{SECTION}.eval reads held-out files like data, but {SECTION}.data.kind = 'synthetic' has none; "
                "allowed: data.kind 'text', 'documents' or 'chat'"]
    held_out = train.model_copy(update={"data": train.data.held_out(train.eval)})
    return [problem.replace(f"{SECTION}.data.paths", f"{SECTION}.eval.paths")
            for problem in data_problems(held_out, base_dir, model, hf_config, pretrained)]


def _located(check: Any, *args: Any) -> list[str]:
    """The problems ``check(*args)`` raises as a ConfigError (none: [])."""
    try:
        check(*args)
    except ConfigError as err:
        return err.located()
    return []


def held_checkpoints(folder: Path) -> list[str]:
    """The step folders (complete or not) of a checkpoint directory, in step order."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("step"))


def lineage_problem(section: CheckpointSection, folder: Path) -> Optional[str]:
    """Why ``resume: false`` must not write into ``folder``: it holds another run's checkpoints, which the new
    run would overwrite step by step and a later resume would mix with its own (None: nothing held, or
    ``overwrite`` set)."""
    held = held_checkpoints(folder)
    if section.resume or section.overwrite or not held:
        return None
    return (f"{SECTION}.checkpoint.resume = false but checkpoint.dir = {section.dir!r} holds another run's "
            f"checkpoints ({', '.join(held[:3])}{' ...' if len(held) > 3 else ''}); a new run would overwrite them "
            "step by step and a later resume could take the old run's steps. Give an empty folder, resume: true to "
            "continue it, or checkpoint.overwrite: true to delete them first")


def engine_problems(train: TrainSection, ds: dict[str, Any]) -> list[str]:
    """What does not fit ``train.engine``: pp > 1 or a ``megatron`` section with DeepSpeed's engine;
    no ``megatron`` section, or DeepSpeed keys other than the batch keys, with Megatron's."""
    found = []
    if train.engine == "deepspeed":
        if train.layout.pp > 1:
            found.append(f"{SECTION}.layout.pp = {train.layout.pp}: engine 'deepspeed' trains one pipeline stage "
                         "(DeepSpeed's engine, not its PipelineEngine); allowed: pp = 1, or "
                         f"{SECTION}.engine = 'megatron' (Megatron's pipeline schedules)")
        if train.megatron is not None:
            found.append(f"{SECTION}.megatron configures engine 'megatron' only, but {SECTION}.engine = 'deepspeed' "
                         "(DeepSpeed's own keys configure its optimizer); drop the section or set engine: 'megatron'")
        return found
    if train.megatron is None:
        found.append(f"{SECTION}.engine = 'megatron' needs a {SECTION}.megatron section (at least "
                     "megatron.optimizer.lr)")
    for key in ds:
        if key not in BATCH_KEYS:
            found.append(f"DeepSpeed key '{key}' has no effect with {SECTION}.engine = 'megatron' (Megatron's "
                         f"optimizer, scheduler, clipping and DDP are set in {SECTION}.megatron, the dtype in the "
                         f"model file); allowed top-level keys: {', '.join(BATCH_KEYS)}")
    return found


def tokenizer_source(train: TrainSection, base_dir: Path, model_checkpoint: Optional[CheckpointSource] = None
                     ) -> tuple[Optional[CheckpointSource], str]:
    """The checkpoint whose tokenizer reads kinds documents/chat, and the field naming it: ``data.tokenizer``,
    else the model's checkpoint (``transformers.checkpoint``, or ``model_checkpoint``: the checkpoint a model
    file names, :attr:`TrainSpec.pretrained`); ``(None, ...)`` when neither exists (a random model)."""
    field = f"{SECTION}.data.tokenizer"
    source = train.data.tokenizer
    if source is None and model_checkpoint is not None:
        own = CheckpointSource(checkpoint=model_checkpoint.checkpoint, gguf_file=model_checkpoint.gguf_file,
                               cache_dir=model_checkpoint.cache_dir)
        return own, f"{SECTION}.model = {train.model!r} (its checkpoint)"
    if source is None and train.transformers is not None:
        own = train.transformers.source(base_dir)  # its paths already resolved
        if own is not None:
            return own, f"{SECTION}.transformers.checkpoint"
    if source is None:
        return None, field
    if source.checkpoint.startswith("package:"):
        return source, field
    return source.model_copy(update={"checkpoint": str(_resolve(source.checkpoint, base_dir, must_exist=True))}), field


def document_problems(train: TrainSection, base_dir: Path, model_config: Any,
                      model_checkpoint: Optional[CheckpointSource] = None) -> list[str]:
    """What stops data.kind documents/chat: no tokenizer (a random model or a model file, and no
    ``data.tokenizer``), attention that would cross documents (not ``"ring"``), pp > 1, missing files, bad
    data (file, line, field), a document longer than seq_len or the model's positions, ids beyond the
    model's vocabulary. ``model_config``: the transformers config or the :class:`GPTConfig`."""
    from megatron_ring.datasets.files import corpus_files
    from megatron_ring.training.tokenized import load_documents, tokenizer_for

    d, found = train.data, []
    if train.transformers is None and train.layout.pp > 1:
        found.append(f"{SECTION}.data.kind = {d.kind!r} with {SECTION}.layout.pp = {train.layout.pp}: packed rows "
                     "differ in length from one micro-batch to the next, which Megatron's pipeline schedules do not "
                     "send between stages; allowed: pp = 1, or data.kind 'text' / 'synthetic'")
    if train.transformers is None and getattr(model_config, "attention", None) not in (None, "ring"):
        found.append(f"attention = {model_config.attention!r} (model file or {SECTION}.attention) would attend "
                     f"across the packed documents of data.kind = {d.kind!r}; allowed: 'ring' (at any cp)")
    if train.transformers is not None and train.transformers.attention != "ring":
        found.append(f"{SECTION}.data.kind = {d.kind!r} packs documents that attend only within themselves, which "
                     f"the ring does at any cp; {SECTION}.transformers.attention = "
                     f"{train.transformers.attention!r}; allowed: 'ring'")
    source, field = tokenizer_source(train, base_dir, model_checkpoint)
    if source is None:
        model = f"{SECTION}.transformers.config is a random model" if train.transformers is not None else \
            f"{SECTION}.model = {train.model!r} is a model file"
        found.append(f"{SECTION}.data.kind = {d.kind!r} tokenizes with the model's own tokenizer, but {model} "
                     f"with none; set {SECTION}.data.tokenizer = {{'checkpoint': ...}} (a checkpoint directory, a "
                     "GGUF file or package:<module>)")
    if not d.paths:
        found.append(f"{SECTION}.data.paths is empty; give the {d.kind} files/folders")
    missing = [i for i, entry in enumerate(d.paths) if not _resolve(entry, base_dir, must_exist=True).exists()]
    for i in missing:
        found.append(f"{SECTION}.data.paths[{i}] = {d.paths[i]!r} does not exist (relative paths start at "
                     f"{str(base_dir)!r})")
    if found or source is None:
        return found
    max_positions = getattr(model_config, "max_position_embeddings", None)  # None for a GPTConfig (RoPE)
    vocab = getattr(model_config, "vocab_size", None) or getattr(getattr(model_config, "model", None), "vocab_size", None)
    if max_positions is not None and train.seq_len > max_positions:
        found.append(f"{SECTION}.seq_len = {train.seq_len}: more than the model's max_position_embeddings = "
                     f"{max_positions}; allowed: at most {max_positions}")
    try:
        tokenizer = tokenizer_for(source, field=field)
        files = corpus_files([_resolve(p, base_dir, must_exist=True) for p in d.paths], d.file_suffixes())
        load_documents(d.kind, files, source, train.seq_len, max_positions)
    except ConfigError as err:
        return found + err.located()
    except ValueError as err:
        return found + [f"{SECTION}.data.paths: {err}"]
    if vocab is not None and len(tokenizer) > vocab:
        found.append(f"{field}: its tokenizer has {len(tokenizer)} ids, more than the model's vocab_size = {vocab}; "
                     "allowed: the model's own tokenizer")
    return found


def check_corpus_length(train: TrainSection, base_dir: Path) -> None:
    """ConfigError unless the text corpus holds one sample, ``seq_len + 1`` tokens (its byte count
    plus one end-of-document token per file, from the files' sizes: nothing is read)."""
    from megatron_ring.datasets.files import corpus_files

    d = train.data
    try:
        files = corpus_files([_resolve(p, base_dir, must_exist=True) for p in d.paths], d.file_suffixes())
    except ValueError as err:
        raise ConfigError(f"{SECTION}.data.paths: {err}") from None
    tokens = sum(f.stat().st_size + 1 for f in files)
    if tokens < train.seq_len + 1:
        raise ConfigError(f"{SECTION}.data.paths = {d.paths} hold {tokens} tokens ({len(files)} files), fewer than "
                          f"{SECTION}.seq_len + 1 = {train.seq_len + 1}, one training sample; "
                          "add text or lower seq_len")


def _model_config(train: TrainSection, base_dir: Path, *, pad: bool) -> tuple[GPTConfig, Optional[Any]]:
    """The model YAML with our layout, ``megatron.sequence_parallel`` (if set), ``seq_len`` padded for
    the layout (:func:`~megatron_ring.training.data.row_length`; ``pad`` False: the file's own, ours
    being rejected already) and attention (if set) written into it; and where its weights come from
    when it names a checkpoint (:mod:`megatron_ring.training.pretrained`), else None."""
    from megatron_ring.training.data import row_length  # a row of any length is padded for zigzag

    path = _resolve(train.model, base_dir, must_exist=True)
    data = copy.deepcopy(load_mapping(path))
    lay = train.layout
    data["parallel"] = {**data.get("parallel", {}), "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "dp": lay.dp}
    if lay.cp_a2a is not None:  # hierarchical CP: the layout's groups are the model's
        data["parallel"]["cp_a2a"] = lay.cp_a2a
    for key in ("sequence_parallel", "cp_comm_type"):  # the section's, over the model file's
        if train.megatron is not None and getattr(train.megatron, key) is not None:
            data["parallel"][key] = getattr(train.megatron, key)
    split = lay.tp if data["parallel"].get("sequence_parallel") is True else 1
    seq_len = row_length(train.seq_len, lay.cp, split) if pad else None
    if seq_len is not None and isinstance(data.get("model"), dict):
        data["model"]["seq_length"] = seq_len
    if train.attention is not None:
        data["attention"] = train.attention
    where = f"model {str(path)!r} with {SECTION}.layout/seq_len"
    if "checkpoint" in data:
        from megatron_ring.training.pretrained import pretrained_gpt_config

        return pretrained_gpt_config(data, seq_len=seq_len, where=where)
    return GPTConfig.parse(data, where=where), None


def load_train_spec(path: str | Path, *, world_size: int) -> TrainSpec:
    """Read and validate a training config file (relative paths inside resolve against its folder): the
    DeepSpeed JSON, or a YAML with Megatron-LM's names (:mod:`megatron_ring.training.megatron_args`)."""
    path = Path(path)
    raw, where = load_mapping(path), f"config {str(path)!r}"
    if is_megatron_args(raw, path):
        return parse_megatron_args(raw, world_size=world_size, base_dir=path.resolve().parent, where=where)
    return parse_train_spec(raw, world_size=world_size, base_dir=path.resolve().parent, where=where)


def parse_megatron_args(raw: Any, *, world_size: int, base_dir: Path, where: str = "config") -> TrainSpec:
    """A YAML mapping with Megatron-LM's names (:mod:`megatron_ring.training.megatron_args`): translated into
    this module's form and validated by :func:`parse_train_spec`, every problem naming the YAML's keys."""
    from megatron_ring.training.megatron_args import renamed, translated

    mapping = translated(raw, world_size=world_size, base_dir=base_dir, where=where)
    try:
        return parse_train_spec(mapping, world_size=world_size, base_dir=base_dir, where=where)
    except ConfigError as err:
        raise ConfigError(*(renamed(p) for p in err.problems), where=err.where) from None
