"""transformers' ``Trainer`` with ring attention under a launcher: set-up and the example run.

``launch/trainer_finetune.py`` calls :func:`trainer_main`; the pieces are public for a script of
your own (docs/training.md, "transformers' Trainer")::

    groups = init_trainer_groups(cp=2)                     # torch.distributed + DeepSpeed comm + our groups
    args = TrainingArguments(output_dir=..., deepspeed="ds_config.json", ...)   # after init_trainer_groups
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring")
    RingTrainer(model=model, args=args, train_dataset=rows, data_collator=collator, groups=groups).train()

Order matters: torch.distributed and DeepSpeed's comm backend are started before
``TrainingArguments`` (whose accelerate state would otherwise start DeepSpeed's backend itself and,
on CPU, JIT-compile its shared-memory op for about 80 s: Note [DeepSpeed's comm backend without the
shared-memory op] in integrations/deepspeed/process_group.py), and before the model is loaded
(ZeRO-3 partitions a model loaded after ``TrainingArguments``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ring.integrations.deepspeed.process_group import init_deepspeed_comm, init_distributed
from megatron_ring.parallel.groups import ParallelGroups, init_parallel, leave_distributed
from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.datasets.files import corpus_files
from megatron_ring.runtime.parent_watch import watch_parent

TEXT_SUFFIXES = (".txt", ".md")
EXIT_USAGE = 2
"""Exit status of the example for bad arguments (nothing was started)."""


@dataclass
class RingTrainerArguments:
    """The example's own arguments (every ``TrainingArguments`` flag is accepted beside them)."""

    model: str = field(metadata={"help": "a local transformers checkpoint folder with its tokenizer"})
    cp: int = field(default=1, metadata={"help": "context-parallel size; dp = processes / cp"})
    attention: str = field(default="ring", metadata={
        "help": "ring (RingTrainer, any cp), or sdpa / eager (transformers' own Trainer, cp 1: the reference)"})
    data: str = field(default="data/corpus", metadata={"help": "a text file or a folder of .txt/.md files"})
    seq_len: int = field(default=64, metadata={"help": "the longest row; rows are 1/2 to 1 times as long"})
    rows: int = field(default=32, metadata={"help": "number of training rows"})


def init_trainer_groups(cp: int, *, deepspeed: bool = False,
                        timeout: timedelta = timedelta(minutes=10)) -> ParallelGroups:
    """Start torch.distributed from the launcher's environment and DeepSpeed's comm backend on it,
    and return the groups of ``cp`` x ``dp = processes / cp`` (tp = pp = 1). Call before ``TrainingArguments``.

    ``deepspeed``: the Trainer will run DeepSpeed; on CPU this also configures accelerate's process
    state for it (Note [DeepSpeed under the Trainer on CPU]), and ``TrainingArguments`` must then be
    built with ``accelerator_config={"use_configured_state": True}`` (:func:`accelerator_config`).
    """
    if not dist.is_initialized():
        init_distributed(timeout=timeout)
    init_deepspeed_comm()
    world = dist.get_world_size()
    if cp < 1 or world % cp:
        raise ValueError(f"cp = {cp} does not divide the {world} processes; allowed: a divisor of {world}")
    groups = init_parallel(ParallelLayout(cp=cp, dp=world // cp), timeout=timeout)
    if deepspeed and needs_configured_state():
        configure_deepspeed_state()
    return groups


def needs_configured_state() -> bool:
    """Whether DeepSpeed under the Trainer needs :func:`configure_deepspeed_state`: on CPU (no GPU, or
    ``DS_ACCELERATOR=cpu``), with more than one process."""
    on_cpu = os.environ.get("DS_ACCELERATOR", "") == "cpu" or not torch.cuda.is_available()
    return on_cpu and dist.is_initialized() and dist.get_world_size() > 1


def configure_deepspeed_state() -> None:
    """accelerate's process state for DeepSpeed over the running gloo group (CPU).

    Note [DeepSpeed under the Trainer on CPU]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``TrainingArguments(deepspeed=...)`` builds accelerate's ``PartialState`` for DeepSpeed without a
    backend; accelerate then looks for a GPU-like device to pick one (nccl, hccl, ...) and, on a CPU
    machine, finds none and falls back to *one process*: every rank would train alone on its own
    batches, silently. Given the backend (``gloo``, the group already running) and DeepSpeed's flag,
    ``PartialState`` adopts the running group with its real world size and marks the state as
    DeepSpeed's; ``TrainingArguments(accelerator_config={"use_configured_state": True})`` makes the
    Trainer take that state instead of building its own. GPUs need none of this.
    """
    from accelerate.state import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        state = PartialState(backend=dist.get_backend())
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    if state.num_processes != dist.get_world_size() or str(state.distributed_type) != "DistributedType.DEEPSPEED":
        raise RuntimeError(f"accelerate's state for DeepSpeed on CPU has {state.num_processes} processes "
                           f"({state.distributed_type}), torch.distributed {dist.get_world_size()}")


def accelerator_config(deepspeed: bool) -> dict[str, Any] | None:
    """The ``TrainingArguments.accelerator_config`` that :func:`init_trainer_groups` asks for, or None."""
    return {"use_configured_state": True} if deepspeed and needs_configured_state() else None


def check_arguments(ours: RingTrainerArguments) -> None:
    """ValueError naming the argument for anything the run cannot use (before any process group)."""
    if ours.attention not in ("ring", "sdpa", "eager"):
        raise ValueError(f"--attention {ours.attention!r}; allowed: ring, sdpa, eager")
    if ours.attention != "ring" and ours.cp != 1:
        raise ValueError(f"--attention {ours.attention} with --cp {ours.cp}: only ring shards a sequence; allowed: cp 1")
    if not (Path(ours.model) / "config.json").is_file():
        raise ValueError(f"--model {ours.model!r} is not a transformers checkpoint folder (no config.json)")
    if ours.seq_len < 2 or ours.rows < 1:
        raise ValueError(f"--seq_len {ours.seq_len} / --rows {ours.rows}; allowed: seq_len >= 2, rows >= 1")


def corpus_rows(tokenizer: Any, data: str, seq_len: int, rows: int) -> list[dict[str, list[int]]]:
    """``rows`` rows ``{"input_ids": [...]}`` cut in order from the text files of ``data`` (each file's
    tokens, then EOS), of lengths ``seq_len`` down to about ``seq_len / 2`` so that batches need padding."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for path in corpus_files([data], TEXT_SUFFIXES):
        ids += tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"] + eos
    out, start = [], 0
    for i in range(rows):
        n = seq_len - (i * 7) % (seq_len // 2 + 1)
        if start + n > len(ids):
            raise ValueError(f"--data {data!r} holds {len(ids)} tokens, too few for {rows} rows of up to {seq_len}")
        out.append({"input_ids": ids[start:start + n]})
        start += n
    return out


def build_trainer(ours: RingTrainerArguments, args: Any, groups: ParallelGroups) -> Any:
    """The example's Trainer: ``RingTrainer`` (``attention = ring``) or transformers' own ``Trainer``,
    the model of ``ours.model`` in fp32, the corpus rows, padding on the right."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

    from megatron_ring.integrations.hf.attention import register
    from megatron_ring.integrations.hf.trainer import RingTrainer, right_padding_collator

    register()
    tokenizer = AutoTokenizer.from_pretrained(ours.model, local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows = corpus_rows(tokenizer, ours.data, ours.seq_len, ours.rows)
    model = AutoModelForCausalLM.from_pretrained(ours.model, attn_implementation=ours.attention,
                                                 dtype=torch.float32, local_files_only=True)
    kwargs = dict(model=model, args=args, train_dataset=rows, data_collator=right_padding_collator(pad))
    if ours.attention == "ring":
        return RingTrainer(groups=groups, **kwargs)
    return Trainer(**kwargs)


def step_losses(trainer: Any) -> list[float]:
    """The logged loss of every step (``logging_steps = 1``), in order."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def trainer_main(argv: Sequence[str] | None = None) -> int:
    """One rank of the example run: parse, set up, train, write ``OUTPUT_DIR/losses.json`` (rank 0)."""
    from transformers import HfArgumentParser, TrainingArguments

    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = HfArgumentParser(RingTrainerArguments).parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True)
    namespace, unknown = HfArgumentParser(TrainingArguments).parse_known_args(rest)
    try:
        if unknown:
            raise ValueError(f"unknown arguments {unknown}")
        check_arguments(ours)
    except ValueError as err:  # before any process group: one line, exit status 2
        print(f"trainer_finetune: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    inputs = {k: v for k, v in vars(namespace).items() if k in fields}
    watch_parent()  # Note [Orphaned ranks]
    groups = init_trainer_groups(ours.cp, deepspeed=bool(inputs.get("deepspeed")))  # before TrainingArguments
    try:
        configured = accelerator_config(bool(inputs.get("deepspeed")))
        if configured is not None:
            if inputs.get("accelerator_config") is not None:
                raise ValueError("--accelerator_config with --deepspeed on CPU: the example sets it "
                                 f"({configured}); allowed: none")
            inputs["accelerator_config"] = configured
        args = TrainingArguments(**inputs)
        trainer = build_trainer(ours, args, groups)
        trainer.train()
        if dist.get_rank() == 0:
            out = Path(args.output_dir) / "losses.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"cp": ours.cp, "dp": groups.layout.dp, "losses": step_losses(trainer)}))
    finally:
        leave_distributed()
    return 0
