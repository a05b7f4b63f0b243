"""The training loop: a Megatron GPT (or a transformers causal LM) with ring attention inside DeepSpeed's
engine, or a Megatron GPT in Megatron-core's own stack (``engine: megatron``,
:mod:`megatron_ring.training.megatron_engine`).

One rank's run (:func:`train_main`, started by ``launch/train.py``):

1. validate the whole config (:func:`~megatron_ring.training.schema.load_train_spec`, DeepSpeed's
   part with DeepSpeed's own parser included) — a bad config stops every rank with exit status 2
   before a process group or a model exists, rank 0 naming every problem;
2. start the peer monitor (:class:`megatron_ring.runtime.faults.PeerMonitor`) and
   torch.distributed from the launcher's environment, then Megatron's ``parallel_state`` for the
   layout (its groups equal :class:`~megatron_ring.parallel.layout.ParallelLayout`'s);
3. build the engine (:func:`~megatron_ring.training.engine.build_engine`, Note [One engine protocol]):
   with ``engine: deepspeed`` the GPT model from the ``configs/megatron`` YAML (or the transformers
   model) inside DeepSpeed's engine (:class:`~megatron_ring.training.deepspeed_engine.DeepSpeedTrainer`),
   with ``engine: megatron`` a :class:`~megatron_ring.training.megatron_engine.MegatronTrainer`;
4. resume from the latest *complete* checkpoint if there is one; then per step: this rank's
   micro-batches (zigzag over CP, split over DP) through ``engine.step`` (forward, backward, optimizer
   step; the global mean token loss: Note [The loss of a context-parallel rank] in
   :mod:`megatron_ring.training.global_loss`), one metrics line, and a checkpoint every
   ``save_interval`` steps and at the end; with an ``eval`` section, the held-out loss
   (:func:`evaluate`) at the start, every ``eval.interval`` steps and at the end.

Checkpoints, their checksums and the resume checks: Note [Complete checkpoints] in
:mod:`megatron_ring.training.checkpoint`. A step whose global loss is not finite stops every rank
(:class:`~megatron_ring.training.checkpoint.TrainingStopped`, exit status :data:`EXIT_STOPPED`)
before it is logged or saved, unless ``stop_on_nonfinite_loss`` is false; even then such a step is
never saved as a complete checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

import torch
import torch.distributed as dist

from megatron_ring.config import ConfigError
from megatron_ring.parallel.groups import ParallelGroups, leave_distributed
from megatron_ring.training.checkpoint import (TrainingStopped, check_layout, check_resume, checkpoint_engine,
                                                latest_checkpoint, load_checkpoint, optimizer_settings, read_marker,
                                                save_checkpoint, verify_checkpoint)
from megatron_ring.datasets.files import corpus_files
from megatron_ring.training.data import Batch, DocumentRows, TrainData, build_samples
from megatron_ring.training.engine import Engine, build_engine
from megatron_ring.training.global_loss import global_sums
from megatron_ring.training.schema import DOCUMENT_KINDS, SECTION, TrainSpec, load_train_spec

EXIT_CONFIG = 2
"""Exit status of every rank when the config is invalid (nothing was started)."""
EXIT_STOPPED = 4
"""Exit status of every rank when training stopped on an unusable checkpoint or a non-finite loss."""


# --- process groups, model, engine -------------------------------------------------------------

def init_model_parallel(spec: TrainSpec, device: torch.device) -> ParallelGroups:
    """Megatron's ``parallel_state`` for the layout (on CPU, integrations/megatron/on_cpu.py) -> our view
    of its groups; for a transformers model our own groups of the layout."""
    if spec.transformers is not None:
        from megatron_ring.parallel.groups import init_parallel

        return init_parallel(spec.layout, timeout=timedelta(seconds=spec.train.collective_timeout_s))
    from megatron_ring.integrations.megatron.state import init_megatron

    section = spec.train.megatron
    return init_megatron(spec.layout, device=device, seed=spec.train.seed, timeout_s=spec.train.collective_timeout_s,
                         virtual_pipeline=section.virtual_pipeline if section is not None else None)


def build_data(spec: TrainSpec, groups: ParallelGroups, *, held_out: bool = False) -> TrainData:
    """This rank's view of the training data (DP rank and CP rank from ``groups``); with ``held_out``, of
    ``eval``'s held-out files, read the same way in order."""
    d = spec.train.data.held_out(spec.train.eval) if held_out else spec.train.data
    files = corpus_files([spec.path(p, existing=True) for p in d.paths], d.file_suffixes()) \
        if d.kind != "synthetic" else ()
    if d.kind in DOCUMENT_KINDS:
        from megatron_ring.training.schema import tokenizer_source
        from megatron_ring.training.tokenized import load_documents

        source, _ = tokenizer_source(spec.train, spec.base_dir,
                                     spec.pretrained.source if spec.pretrained is not None else None)
        docs = load_documents(d.kind, files, source, spec.train.seq_len)
        samples = DocumentRows(docs, spec.train.seq_len, packing=d.packing, source=d.kind)
    else:
        samples = build_samples(d.kind, vocab_size=spec.vocab_size, seq_len=spec.train.seq_len, files=files,
                                synthetic_samples=d.synthetic_samples, seed=d.seed)
    split = spec.layout.tp if spec.model is not None and spec.model.parallel.sequence_parallel else 1
    return TrainData(samples, micro_batch=spec.micro_batch, grad_accum=spec.grad_accum, dp=spec.layout.dp,
                     dp_rank=groups.coords["dp"], cp=spec.layout.cp, cp_rank=groups.cp_rank,
                     shuffle=d.shuffle, seed=d.seed, split=split)


# --- one step ----------------------------------------------------------------------------------

def train_step(engine: Engine, batches: Sequence[Batch]) -> float:
    """One optimizer step over this rank's micro-batches; the global mean token loss (``engine.step``)."""
    return engine.step(batches)


def evaluate(engine: Engine, held_out: TrainData, groups: ParallelGroups, device: torch.device) -> tuple[float, int]:
    """``(mean token loss, tokens)`` over every held-out row once, forward only, the same on every rank.

    Rows go out as training batches do (``global_batch`` rows per round, zigzag over CP, split over DP);
    the last round's slots past the end repeat earlier rows with a zero loss mask, so that every rank
    runs the same forwards (ZeRO-3 gathers parameters in each) and no row counts twice.
    """
    rows = len(held_out.samples)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for round_ in range(-(-rows // held_out.global_batch)):
        total += engine.eval_sums(held_out.step_batches(round_, limit=rows))
    global_sums(total, groups)
    if total[1] == 0:
        raise ValueError("the held-out data has no token with a loss (loss_mask is all zero)")
    return float(total[0] / total[1]), int(total[1])


def memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: the allocator peak on a GPU, the process's peak RSS on CPU."""
    from megatron_ring.runtime.reporting import peak_memory

    peak = peak_memory(device)
    return int(peak["peak_device_bytes"] if device.type == "cuda" else peak["peak_rss_bytes"])


def gather_ints(value: int, device: torch.device) -> list[int]:
    """``value`` of every rank, in rank order (one small all-gather)."""
    mine = torch.tensor([value], dtype=torch.long, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(v) for v in every]


# --- the run -----------------------------------------------------------------------------------

@dataclass
class TrainRun:
    """What :func:`train` leaves: the engine, the step it resumed from, one record per step and the held-out losses."""

    engine: Engine
    start_step: int
    records: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The held-out loss records (``eval`` section), in order."""


class StepLog:
    """Rank 0's JSON-lines log (one line per step, flushed) and progress bar; silent elsewhere."""

    def __init__(self, spec: TrainSpec, rank: int, start_step: int) -> None:
        from megatron_ring.runtime.reporting import progress

        self._file: Optional[TextIO] = None
        if rank == 0 and spec.train.log.jsonl:
            path = spec.path(spec.train.log.jsonl)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a" if start_step else "w")
        self._bar = progress(spec.train.steps, enabled=rank == 0 and spec.train.log.progress,
                             desc=f"{spec.train.name} ({spec.layout.describe()})")
        self._bar.update(start_step)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def step(self, record: dict[str, Any]) -> None:
        self.write(record)
        self._bar.update(1)
        self._bar.set_postfix_str(f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s")

    def close(self) -> None:
        self._bar.close()
        if self._file is not None:
            self._file.close()


def train(spec: TrainSpec, groups: ParallelGroups, device: torch.device) -> TrainRun:
    """Build the engine, resume if a complete checkpoint exists, and train to ``spec.train.steps``."""
    data = build_data(spec, groups)
    held_out = build_data(spec, groups, held_out=True) if spec.train.eval is not None else None
    engine = build_engine(spec, groups, device)
    ck = spec.train.checkpoint
    ckpt_dir = spec.path(ck.dir) if ck.dir else None
    if ckpt_dir is not None and not ck.resume and ck.overwrite:  # a new lineage: the old one goes first
        if dist.get_rank() == 0:
            from megatron_ring.training.schema import held_checkpoints

            for name in held_checkpoints(ckpt_dir):
                shutil.rmtree(ckpt_dir / name)
        dist.barrier()
    try:
        start, saved_layout = resume(engine, spec, data, ckpt_dir) if ck.resume else (0, None)
    except BaseException:  # a refused checkpoint: the engine lets go of its groups (a pool worker goes on)
        engine.destroy()
        raise
    run = TrainRun(engine=engine, start_step=start)
    rank, world = dist.get_rank(), dist.get_world_size()
    log = StepLog(spec, rank, start)
    log.write({"event": "start", "step": start, "engine": spec.train.engine, "layout": spec.layout.sizes(),
               "world_size": world, "global_batch": spec.global_batch, "seq_len": spec.train.seq_len,
               "resumed_from": start or None, "resumed_layout": saved_layout,
               "pids": gather_ints(os.getpid(), device)})
    interval = spec.train.eval.interval if spec.train.eval is not None else 0

    def log_eval(step: int) -> None:
        t0 = time.perf_counter()
        loss, tokens = evaluate(engine, held_out, groups, device)
        record = {"event": "eval", "step": step, "eval_loss": loss, "eval_tokens": tokens,
                  "eval_s": time.perf_counter() - t0}
        run.evals.append(record)
        log.write(record)

    try:
        if held_out is not None:
            log_eval(start)
        for step in range(start, spec.train.steps):
            t0 = time.perf_counter()
            loss = train_step(engine, data.step_batches(step))
            seconds = time.perf_counter() - t0
            finite = math.isfinite(loss)
            if not finite and spec.train.stop_on_nonfinite_loss:
                raise TrainingStopped(nonfinite_message(loss, step + 1, ckpt_dir))
            tokens = data.tokens_per_step(step)
            record = {
                "step": step + 1, "loss": loss, "lr": engine.lr(),
                "tokens": tokens, "step_s": seconds, "tokens_per_s": tokens / seconds,
                "consumed_samples": (step + 1) * spec.global_batch,
                "memory_bytes_per_rank": gather_ints(memory_bytes(device), device),
            }
            run.records.append(record)
            log.step(record)
            last = step + 1 == spec.train.steps
            if held_out is not None and (last or (interval and (step + 1) % interval == 0)):
                log_eval(step + 1)
            due = last or (ck.save_interval and (step + 1) % ck.save_interval == 0)
            if ckpt_dir is not None and due and not finite:
                log.write({"event": "checkpoint_skipped", "step": step + 1, "reason": f"loss is {loss}"})
            elif ckpt_dir is not None and due:
                state = {"step": step + 1, "consumed_samples": (step + 1) * spec.global_batch,
                         "layout": spec.layout.sizes(), "data": data.fingerprint(),
                         "settings": optimizer_settings(spec), **model_record(spec)}
                tag = save_checkpoint(engine, ckpt_dir, step + 1, state)
                log.write({"event": "checkpoint", "step": step + 1, "tag": tag})
    finally:
        log.close()
    return run


def resume(engine: Engine, spec: TrainSpec, data: TrainData, ckpt_dir: Optional[Path]) -> tuple[int, Optional[dict]]:
    """Load the latest complete checkpoint of ``ckpt_dir`` into ``engine`` after every check (engine, layout,
    digests, data, optimizer settings); ``(its step, its layout)``, or ``(0, None)`` when there is none."""
    if ckpt_dir is None or (tag := latest_checkpoint(ckpt_dir)) is None:
        return 0, None
    marker = read_marker(ckpt_dir / tag)
    if (saved := checkpoint_engine(marker, ckpt_dir / tag)) != engine.name:
        raise ConfigError(f"checkpoint {str(ckpt_dir / tag)!r} was saved by engine {saved!r} but "
                          f"{SECTION}.engine = {spec.train.engine!r}; each engine loads its own checkpoints "
                          "(megatron-ring export turns either into a transformers checkpoint to start from)")
    if not engine.reshards:
        check_layout(marker, spec.layout.sizes(), ckpt_dir / tag)
    verify_checkpoint(marker, ckpt_dir / tag)
    client = load_checkpoint(engine, ckpt_dir, tag)
    check_resume(client, data, spec, ckpt_dir / tag)
    return int(client["step"]), marker.get("layout")


def model_record(spec: TrainSpec) -> dict[str, Any]:
    """What a checkpoint records of its model for ``megatron-ring export`` (:mod:`megatron_ring.training.export`):
    the engine, and for a transformers model its config and where its tokenizer is."""
    record: dict[str, Any] = {"engine": spec.train.engine}
    if spec.transformers is not None:
        from megatron_ring.training.hf_schema import transformers_record

        record["transformers"] = transformers_record(spec.train.transformers, spec.base_dir, spec.transformers)
    return record


def nonfinite_message(loss: float, step: int, ckpt_dir: Optional[Path]) -> str:
    """Why training stopped at ``step``: the loss, the checkpoint resume would take, the switch."""
    latest = latest_checkpoint(ckpt_dir) if ckpt_dir is not None else None
    kept = f"the latest complete checkpoint stays {str(ckpt_dir / latest)!r}" if latest else "no checkpoint was saved"
    return (f"step {step}: the global loss is {loss}; training stopped before saving this step ({kept}). "
            f"Look for a corrupted checkpoint or too high a learning rate; {SECTION}.stop_on_nonfinite_loss = false "
            "trains on (such steps are never saved)")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """``CONFIG`` or ``--deepspeed_config CONFIG`` (either kind: :func:`~megatron_ring.training.schema.load_train_spec`)
    and the deepspeed launcher's ``--local_rank``."""
    parser = argparse.ArgumentParser(description="Train a Megatron GPT (or a transformers model) with ring attention: "
                                     "one rank of a job started by torchrun or the deepspeed launcher.")
    parser.add_argument("config_file", nargs="?", default=None, metavar="CONFIG",
                        help="a training YAML with Megatron-LM's names, or a DeepSpeed training JSON")
    parser.add_argument("--deepspeed_config", "--config", dest="config", default=None,
                        help="DeepSpeed training JSON with a 'megatron_ring' section (or the YAML)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (unused)")
    args = parser.parse_args(argv)
    if (args.config is None) == (args.config_file is None):
        parser.error("give the config once: CONFIG or --deepspeed_config CONFIG")
    args.config = args.config or args.config_file
    return args


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one training job on this rank; return the exit status."""
    from megatron_ring.integrations.deepspeed import process_group as ds_glue
    from megatron_ring.runtime.faults import PeerMonitor
    from megatron_ring.runtime.parent_watch import watch_parent

    args = parse_args(argv)
    env = ds_glue.launch_env()
    try:
        spec = load_train_spec(args.config, world_size=env["world_size"])
    except ConfigError as err:
        if env["rank"] == 0:
            print(f"[megatron_ring] config error, nothing was started:\n{err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    watch_parent(f"rank {env['rank']}")  # Note [Orphaned ranks]
    monitor = PeerMonitor(timeout_s=spec.train.peer_timeout_s).start()
    try:
        device, _ = ds_glue.init_distributed(timeout=timedelta(seconds=spec.train.collective_timeout_s))
        rank = dist.get_rank()
        monitor.attach(dist.distributed_c10d._get_default_store(), rank, dist.get_world_size())
        groups = init_model_parallel(spec, device)
        run = train(spec, groups, device)
        monitor.done()
        dist.barrier()
    except ConfigError as err:
        monitor.done()
        print(f"[megatron_ring] rank {env['rank']}: config error:\n{err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except TrainingStopped as err:  # every rank reaches the same verdict (gathered or all-reduced)
        if err.__cause__ is not None:  # a save failed under us: a collective broken by a lost peer names the peer
            monitor.stop_if_lost(wait_s=3 * monitor.interval_s + 1)
        monitor.done()
        print(f"[megatron_ring] rank {env['rank']}: training stopped: {err}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    except Exception:
        monitor.stop_if_lost(wait_s=3 * monitor.interval_s + 1)
        raise
    if rank == 0 and run.records:
        first, last = run.records[0], run.records[-1]
        held_out = f"; held-out loss {run.evals[0]['eval_loss']:.4f} -> {run.evals[-1]['eval_loss']:.4f}" \
            if run.evals else ""
        print(f"[megatron_ring] steps {run.start_step + 1}..{last['step']}: loss {first['loss']:.4f} -> "
              f"{last['loss']:.4f}, {last['tokens_per_s']:,.0f} tok/s{held_out}", flush=True)
    elif rank == 0:
        print(f"[megatron_ring] the checkpoint is already at step {run.start_step} = {SECTION}.steps; "
              "nothing to train", flush=True)
    leave_distributed()
    return 0
