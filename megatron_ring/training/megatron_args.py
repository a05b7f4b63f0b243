"""A training YAML with Megatron-LM's argument names: the front end a Megatron user recognises.

Megatron-LM is configured by ``pretrain_gpt.py --tensor-model-parallel-size 2 ...`` or the same
names in a YAML (``--yaml-cfg``; NeMo / Megatron-Bridge recipes). This file takes those names,
flat, with underscores, and Megatron-LM's defaults::

    model: ../megatron/tiny_ring_4layers.yaml   # ours: the GPT (sizes, dtype, attention) or a checkpoint
    tensor_model_parallel_size: 1
    pipeline_model_parallel_size: 2
    context_parallel_size: 2
    num_layers_per_virtual_pipeline_stage: 1
    micro_batch_size: 4
    global_batch_size: 8
    seq_length: 128
    train_iters: 60
    lr: 3.0e-3
    lr_decay_style: cosine
    lr_warmup_iters: 10
    data_path: [../../data/corpus]

and runs as engine ``megatron`` (:mod:`megatron_ring.training.megatron_engine`): :func:`translate`
writes the DeepSpeed-JSON form's mapping (batch keys plus the ``megatron_ring`` section,
:mod:`megatron_ring.training.schema`), which :func:`~megatron_ring.training.schema.parse_megatron_args`
validates with the same :func:`~megatron_ring.training.schema.parse_train_spec` as the JSON, so both
forms are one code path and train alike. The data-parallel size is Megatron's: the world size over tp * pp * cp.

Problems name this file's keys: unknown keys with a did-you-mean (:class:`MegatronArgs`), the
layout rules Megatron checks at start-up (:func:`layout_problems`: tp dividing the heads, sequence
parallelism with tp > 1, virtual stages dividing the layers, micro-batches a multiple of pp when
interleaved) before anything is translated, and the translated config's problems with its field
names turned back into these (:data:`RENAMED`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field

from megatron_ring.config import ConfigError, StrictModel, load_mapping
from megatron_ring.config.gpt import CpCommType

SECTION = "megatron_ring"


class MegatronArgs(StrictModel):
    """Every key of a Megatron-LM-style training YAML (Megatron-LM's names and defaults; ``model``,
    ``name``, ``attention``, ``log_jsonl``, ``log_progress`` and ``data_suffixes`` are ours)."""

    # ours: what Megatron-LM gives as model flags or a --spec
    model: str = Field(..., description="configs/megatron model file: sizes, dtype, attention (or a checkpoint)")
    name: str = "train"
    attention: Optional[Literal["local", "sdpa", "ring"]] = Field(None, description="override the model file's")
    log_jsonl: Optional[str] = Field(None, description="JSON-lines log of every step (rank 0)")
    log_progress: bool = True
    # parallelism
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    cp_comm_type: Optional[CpCommType | list[CpCommType]] = Field(None, description="None: the model file's")
    hierarchical_context_parallel_sizes: Optional[list[int]] = Field(None, min_length=2, max_length=2)
    sequence_parallel: bool = False
    num_layers_per_virtual_pipeline_stage: Optional[int] = Field(None, ge=1)
    num_virtual_stages_per_pipeline_rank: Optional[int] = Field(None, ge=1)
    # batch and length
    micro_batch_size: int = Field(..., ge=1)
    global_batch_size: Optional[int] = Field(None, ge=1, description="None: micro_batch_size * data-parallel size")
    seq_length: int = Field(..., ge=2)
    train_iters: int = Field(..., ge=1)
    seed: int = 1234
    # optimizer and schedule
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(..., gt=0)
    min_lr: float = Field(0.0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    lr_warmup_iters: int = Field(0, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    sgd_momentum: float = Field(0.9, ge=0)
    clip_grad: float = Field(1.0, ge=0)
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = Field(None, ge=1)
    accumulate_allreduce_grads_in_fp32: bool = False
    # activation recomputation
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    recompute_method: Optional[Literal["uniform", "block"]] = None
    recompute_num_layers: Optional[int] = Field(None, ge=1)
    # data, evaluation, checkpoints
    data_path: list[str] = Field(default_factory=list, description="text files or folders (byte-level tokens)")
    data_suffixes: Optional[list[str]] = Field(None, description="ours: file endings searched for in folders")
    mock_data: bool = Field(False, description="synthetic tokens instead of data_path")
    valid_data_path: Optional[list[str]] = Field(None, min_length=1, description="held-out text files or folders")
    eval_interval: int = Field(0, ge=0, description="held-out loss every N steps (with valid_data_path)")
    save: Optional[str] = Field(None, description="checkpoint folder")
    load: Optional[str] = Field(None, description="resume from here: the save folder")
    save_interval: int = Field(0, ge=0, description="0: at the end only")


FIELDS: dict[str, str] = {
    "model": f"{SECTION}.model", "name": f"{SECTION}.name", "attention": f"{SECTION}.attention",
    "log_jsonl": f"{SECTION}.log.jsonl", "log_progress": f"{SECTION}.log.progress",
    "tensor_model_parallel_size": f"{SECTION}.layout.tp", "pipeline_model_parallel_size": f"{SECTION}.layout.pp",
    "context_parallel_size": f"{SECTION}.layout.cp",
    "cp_comm_type": f"{SECTION}.megatron.cp_comm_type", "sequence_parallel": f"{SECTION}.megatron.sequence_parallel",
    "micro_batch_size": "train_micro_batch_size_per_gpu", "global_batch_size": "train_batch_size",
    "seq_length": f"{SECTION}.seq_len", "train_iters": f"{SECTION}.steps", "seed": f"{SECTION}.seed",
    "optimizer": f"{SECTION}.megatron.optimizer.type",
    **{key: f"{SECTION}.megatron.optimizer.{key}" for key in (
        "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad",
        "use_distributed_optimizer")},
    "lr_decay_style": f"{SECTION}.megatron.scheduler.decay_style",
    "lr_warmup_iters": f"{SECTION}.megatron.scheduler.warmup_steps",
    "overlap_grad_reduce": f"{SECTION}.megatron.ddp.overlap_grad_reduce",
    "overlap_param_gather": f"{SECTION}.megatron.ddp.overlap_param_gather",
    "ddp_bucket_size": f"{SECTION}.megatron.ddp.bucket_size",
    "accumulate_allreduce_grads_in_fp32": f"{SECTION}.megatron.ddp.grad_reduce_in_fp32",
    "recompute_granularity": f"{SECTION}.megatron.recompute.granularity",
    "recompute_method": f"{SECTION}.megatron.recompute.method",
    "recompute_num_layers": f"{SECTION}.megatron.recompute.num_layers",
    "data_path": f"{SECTION}.data.paths", "data_suffixes": f"{SECTION}.data.suffixes", "valid_data_path": f"{SECTION}.eval.paths",
    "eval_interval": f"{SECTION}.eval.interval",
    "save": f"{SECTION}.checkpoint.dir", "save_interval": f"{SECTION}.checkpoint.save_interval",
}
"""Key of this file -> the dotted field of the JSON form it is written to (:func:`translate`)."""

RENAMED: dict[str, str] = {
    **{dotted: key for key, dotted in FIELDS.items()},
    f"{SECTION}.megatron.virtual_pipeline": "virtual pipeline stages per rank",
    f"{SECTION}.checkpoint.resume = false": "load is not set",
    f"{SECTION}.layout.dp": "the data-parallel size (world / (tp * pp * cp))",
    "gradient_accumulation_steps": "micro-batches per step (global_batch_size / (micro_batch_size * dp))",
    "parallel.tp": "tensor_model_parallel_size", "parallel.pp": "pipeline_model_parallel_size",
    "parallel.cp_a2a": "hierarchical_context_parallel_sizes[0]", "parallel.cp_comm_type": "cp_comm_type",
    "parallel.sequence_parallel": "sequence_parallel", "parallel.cp": "context_parallel_size",
    "layout.tp": "tensor_model_parallel_size", "layout.pp": "pipeline_model_parallel_size",
    "layout.cp": "context_parallel_size",
    f"{SECTION}.seq_len": "seq_length", "model.seq_length": "seq_length (padded)",
    "optimizer.lr": "lr", "optimizer.min_lr": "min_lr",
    "recompute.granularity": "recompute_granularity", "recompute.method": "recompute_method",
    "recompute.num_layers": "recompute_num_layers",
}
"""Field names of the translated config (and of the model file's checks) -> this file's keys, for its errors."""
_RENAME = re.compile("|".join(re.escape(k) for k in sorted(RENAMED, key=len, reverse=True)) + r"(?![\w.])")


def renamed(problem: str) -> str:
    """``problem`` of the translated config with its field names as this file names them."""
    return _RENAME.sub(lambda m: RENAMED[m.group(0)], problem)


def data_parallel_size(args: MegatronArgs, world_size: int, where: Optional[str] = None) -> int:
    """Megatron's data-parallel size: ``world_size / (tp * pp * cp)``; ConfigError when it does not divide."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by tensor_model_parallel_size * "
                          f"pipeline_model_parallel_size * context_parallel_size = {args.tensor_model_parallel_size} "
                          f"* {args.pipeline_model_parallel_size} * {args.context_parallel_size} = {model_parallel}; "
                          f"launch a multiple of {model_parallel} processes", where=where)
    return world_size // model_parallel


def model_sizes(args: MegatronArgs, base_dir: Path) -> Optional[tuple[int, int]]:
    """``(num_layers, num_attention_heads)`` of the model file (a checkpoint's from its config), or None
    when the file cannot be read (its own problems are reported by the translated config's validation)."""
    path = Path(args.model) if Path(args.model).is_absolute() else base_dir / args.model
    if not path.exists() and Path(args.model).exists():
        path = Path(args.model)
    try:
        data = load_mapping(path)
        if isinstance(data, dict) and "checkpoint" in data:
            from megatron_ring.training.pretrained import pretrained_gpt_config

            model = pretrained_gpt_config(data, seq_len=None, where=f"model {str(path)!r}")[0].model
            return model.num_layers, model.num_attention_heads
        model = data["model"]
        return int(model["num_layers"]), int(model["num_attention_heads"])
    except (ConfigError, OSError, KeyError, TypeError, ValueError):
        return None


def virtual_stages(args: MegatronArgs, num_layers: Optional[int]) -> tuple[Optional[int], list[str]]:
    """Model chunks per pipeline rank (None: not interleaved) and the problems of the two keys giving them."""
    per_stage, stages = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    if per_stage is not None and stages is not None:
        return None, ["num_layers_per_virtual_pipeline_stage and num_virtual_stages_per_pipeline_rank are both set; "
                      "give one"]
    if per_stage is None and stages is None:
        return None, []
    if pp == 1:
        key = "num_layers_per_virtual_pipeline_stage" if per_stage is not None else "num_virtual_stages_per_pipeline_rank"
        return None, [f"{key} interleaves pipeline stages and needs pipeline_model_parallel_size > 1, got 1"]
    if num_layers is None:
        return stages, []
    if per_stage is not None:
        if num_layers % (pp * per_stage):
            return None, [f"num_layers_per_virtual_pipeline_stage = {per_stage}: the model's num_layers = {num_layers} "
                          f"is not divisible by pipeline_model_parallel_size * num_layers_per_virtual_pipeline_stage "
                          f"= {pp * per_stage}; allowed: a divisor of {num_layers // pp} layers per stage"]
        stages = num_layers // (pp * per_stage)
        if stages == 1:
            return None, []  # one chunk per rank: plain 1F1B, as Megatron
        return stages, []
    assert stages is not None
    if num_layers % (pp * stages):
        return None, [f"num_virtual_stages_per_pipeline_rank = {stages}: the model's num_layers = {num_layers} is not "
                      f"divisible by pipeline_model_parallel_size * num_virtual_stages_per_pipeline_rank = "
                      f"{pp * stages}"]
    return (stages if stages > 1 else None), []


def layout_problems(args: MegatronArgs, *, dp: int, sizes: Optional[tuple[int, int]],
                    chunks: Optional[int]) -> list[str]:
    """What Megatron refuses at start-up, named by this file's keys: heads not divisible by tp, sequence
    parallelism without tp > 1, the global batch against micro-batches x dp, and with interleaving
    micro-batches per step not a multiple of pp."""
    found = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if sizes is not None and sizes[1] % tp:
        heads = sizes[1]
        found.append(f"tensor_model_parallel_size = {tp} does not divide the model's num_attention_heads = {heads}; "
                     f"allowed: {[d for d in range(1, heads + 1) if heads % d == 0]}")
    if args.sequence_parallel and tp == 1:
        found.append("sequence_parallel = true needs tensor_model_parallel_size > 1 (it splits the sequence over the "
                     "TP ranks), got 1; allowed: false, or tp > 1")
    glob = args.global_batch_size or args.micro_batch_size * dp
    if glob % (args.micro_batch_size * dp):
        found.append(f"global_batch_size = {glob} is not divisible by micro_batch_size * data-parallel size = "
                     f"{args.micro_batch_size} * {dp}; allowed: a multiple of {args.micro_batch_size * dp}")
    elif chunks is not None and (glob // (args.micro_batch_size * dp)) % pp:
        micro_batches = glob // (args.micro_batch_size * dp)
        found.append(f"global_batch_size = {glob} gives {micro_batches} micro-batches per step (global_batch_size / "
                     f"(micro_batch_size {args.micro_batch_size} * data-parallel size {dp})): the interleaved schedule "
                     f"({chunks} virtual stages) runs them in groups of pipeline_model_parallel_size = {pp}, so they "
                     f"must be a multiple of {pp}")
    if args.hierarchical_context_parallel_sizes is not None:
        a2a, ring = args.hierarchical_context_parallel_sizes
        if a2a * ring != args.context_parallel_size:
            found.append(f"hierarchical_context_parallel_sizes = [{a2a}, {ring}]: their product must be "
                         f"context_parallel_size = {args.context_parallel_size}")
    if args.load is not None and args.load != args.save:
        found.append(f"load = {args.load!r} is not save = {args.save!r}: training resumes from the folder it saves "
                     "to; allowed: load equal to save, or unset (a new run)")
    return found


def translate(args: MegatronArgs, *, dp: int, chunks: Optional[int]) -> dict[str, Any]:
    """The DeepSpeed-JSON form's mapping of ``args`` (engine megatron) for ``dp`` data-parallel ranks."""
    glob = args.global_batch_size or args.micro_batch_size * dp
    megatron: dict[str, Any] = {
        "optimizer": {"type": args.optimizer, "lr": args.lr, "min_lr": args.min_lr, "weight_decay": args.weight_decay,
                      "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2, "adam_eps": args.adam_eps,
                      "sgd_momentum": args.sgd_momentum, "clip_grad": args.clip_grad,
                      "use_distributed_optimizer": args.use_distributed_optimizer},
        "ddp": {"overlap_grad_reduce": args.overlap_grad_reduce, "overlap_param_gather": args.overlap_param_gather,
                "bucket_size": args.ddp_bucket_size, "grad_reduce_in_fp32": args.accumulate_allreduce_grads_in_fp32},
        "scheduler": {"warmup_steps": args.lr_warmup_iters, "decay_style": args.lr_decay_style},
        "recompute": {"granularity": args.recompute_granularity, "method": args.recompute_method,
                      "num_layers": args.recompute_num_layers},
        "virtual_pipeline": chunks, "sequence_parallel": args.sequence_parallel, "cp_comm_type": args.cp_comm_type,
    }
    layout = {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
              "cp": args.context_parallel_size, "dp": dp}
    if args.hierarchical_context_parallel_sizes is not None:
        layout["cp_a2a"] = args.hierarchical_context_parallel_sizes[0]
    ours: dict[str, Any] = {
        "name": args.name, "engine": "megatron", "model": args.model, "layout": layout,
        "seq_len": args.seq_length, "steps": args.train_iters, "seed": args.seed, "megatron": megatron,
        "data": {"kind": "synthetic", "seed": args.seed} if args.mock_data else
        {"kind": "text", "paths": args.data_path, "suffixes": args.data_suffixes, "seed": args.seed},
        "checkpoint": {"dir": args.save, "save_interval": args.save_interval, "resume": args.load is not None},
        "log": {"jsonl": args.log_jsonl, "progress": args.log_progress},
    }
    if args.attention is not None:
        ours["attention"] = args.attention
    if args.valid_data_path is not None:
        ours["eval"] = {"paths": args.valid_data_path, "interval": args.eval_interval}
    return {"train_batch_size": glob, "train_micro_batch_size_per_gpu": args.micro_batch_size, SECTION: ours}


def is_megatron_args(raw: Any, path: Path) -> bool:
    """Whether a loaded config file is this kind: a YAML mapping without a ``megatron_ring`` section that
    names Megatron-LM's training keys."""
    return (path.suffix in (".yaml", ".yml") and isinstance(raw, dict) and SECTION not in raw
            and bool({"train_iters", "micro_batch_size", "tensor_model_parallel_size"} & set(raw)))


def translated(raw: Any, *, world_size: int, base_dir: Path, where: str = "config") -> dict[str, Any]:
    """The JSON form's mapping of a Megatron-LM-style mapping for ``world_size`` processes, after the
    checks named by this file's keys (one ConfigError); the caller validates it with
    :func:`~megatron_ring.training.schema.parse_train_spec`, its problems passed through :func:`renamed`."""
    args = MegatronArgs.parse(raw, where=where)
    dp = data_parallel_size(args, world_size, where)
    sizes = model_sizes(args, base_dir)
    chunks, found = virtual_stages(args, sizes[0] if sizes else None)
    found += layout_problems(args, dp=dp, sizes=sizes, chunks=chunks)
    if args.mock_data and args.data_path:
        found.append("mock_data = true and data_path are both given; give one")
    if not args.mock_data and not args.data_path:
        found.append("data_path is empty; give text files or folders, or mock_data: true")
    if args.valid_data_path is None and args.eval_interval:
        found.append(f"eval_interval = {args.eval_interval} needs valid_data_path (held-out files)")
    if found:
        raise ConfigError(*found, where=where)
    return translate(args, dp=dp, chunks=chunks)
