"""One inference run on one rank: validate, start, build, serve, measure, report.

Started on every rank by a launcher (``launch/infer.py`` or ``python -m
megatron_ring.inference.main``)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 launch/infer.py --deepspeed_config configs/deepspeed/cpu_ring_cp4.json
    torchrun --nproc_per_node 4 launch/infer.py --deepspeed_config configs/deepspeed/cpu_ring_cp4.json

Order matters: the whole config (DeepSpeed's keys, our section, the layout against the world
size, the model against the layout) is validated before any process group or model exists; the
peer monitor starts before any thread (see Note [Lost ranks]); the result file is written by
rank 0 after every rank is done, atomically.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.config import ConfigError, Problems, load_mapping
from megatron_ring.inference.loop import job_timings, run_requests
from megatron_ring.inference.metrics import RequestTiming, format_table, median_metrics, request_metrics
from megatron_ring.inference.prompts import answers, text_prompts
from megatron_ring.inference.schema import InferenceSpec, runner_module, validate
from megatron_ring.inference.text_check import check_text_prompts
from megatron_ring.integrations.deepspeed import config as ds_config
from megatron_ring.integrations.deepspeed import process_group as ds_glue
from megatron_ring.inference.runners.protocol import ModelRunner
from megatron_ring.parallel.groups import ParallelGroups, init_parallel, leave_distributed
from megatron_ring.runtime.faults import PeerMonitor
from megatron_ring.runtime.parent_watch import watch_parent
from megatron_ring.runtime.reporting import peak_memory, progress, write_json_atomic

RESULT_SCHEMA = "megatron_ring.inference.result/1"
EXIT_CONFIG = 2
"""Exit status of a rank whose config was rejected (before anything started)."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/infer.py",
        description="Prefill + greedy decode under TP/PP/CP from a DeepSpeed inference config with a "
        "'megatron_ring' section; prints a metrics table and writes a JSON result.")
    parser.add_argument("--deepspeed_config", "--config", dest="config", required=True, metavar="JSON",
                        help="config file (configs/deepspeed/*.json)")
    parser.add_argument("--output", default=None, help="result JSON path (overrides megatron_ring.output)")
    parser.add_argument("--local_rank", type=int, default=None,
                        help="set by the deepspeed launcher; LOCAL_RANK from the environment is used")
    return parser.parse_args(argv)


def load_spec(path: str | Path, *, world_size: int, output: str | None = None,
              workload: dict[str, Any] | None = None) -> InferenceSpec:
    """Load and validate a full config for ``world_size`` ranks; build nothing.

    output: the ``--output`` flag (replaces ``megatron_ring.output``); workload: keys that replace
    those of ``megatron_ring.workload`` (a value None drops the key), for a command that serves its own
    requests with the config's model and layout (``megatron-ring niah``). One :class:`ConfigError`
    names every problem of DeepSpeed's keys and of our section.
    """
    path = Path(path)
    where = f"config {str(path)!r}"
    ds, ours = ds_config.split_config(load_mapping(path), where=where)
    if workload is not None and isinstance(ours, dict) and isinstance(ours.get("workload"), dict):
        merged = {**ours["workload"], **workload}
        ours = {**ours, "workload": {key: value for key, value in merged.items() if value is not None}}
    problems = Problems(where=where)
    ds_cfg = problems.run(ds_config.check_deepspeed_config, ds)
    dtype = ds_config.dtype_name(ds_cfg.dtype) if ds_cfg is not None else None
    spec = problems.run(validate, ours, ds, world_size=world_size, dtype=dtype, path=path, output=output)
    problems.raise_if_any()
    return spec


def _rank_info(rank: int, coords: dict[str, int], device: torch.device, loop: Any) -> dict[str, Any]:
    mem = peak_memory(device)
    return {
        "rank": rank, "coords": coords,
        "peak_mem_bytes": mem["peak_device_bytes"] if mem["peak_device_bytes"] is not None else mem["peak_rss_bytes"],
        **mem,
        "kv_cache_bytes": loop.kv_cache_bytes,
        "comm_prefill_bytes": loop.comm_bytes["prefill"],
        "comm_decode_bytes": loop.comm_bytes["decode"],
        "timings": [{"prefill_s": t.prefill_s, "step_s": t.step_s} for t in loop.timings],
        "generated": loop.generated,
    }


def build_result(spec: InferenceSpec, ranks: list[dict[str, Any]], *, device: torch.device, backend: str,
                 dtype: torch.dtype, attention_kernel: str, started: datetime, wall_s: float,
                 text: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result document from every rank's :func:`_rank_info` (rank order); ``text``: ``prompts``
    (a record per row) and ``generated_text`` (each row's answer) of text prompts."""
    layout, work = spec.layout, spec.ring.workload
    per_rank = [[RequestTiming(t["prefill_s"], list(t["step_s"])) for t in r["timings"]] for r in ranks]
    requests = [request_metrics(t, sequences=layout.dp * work.batch, prompt_len=work.prompt_len)
                for t in job_timings(per_rank)]
    return {
        "schema": RESULT_SCHEMA,
        "name": spec.name,
        "config": str(spec.path) if spec.path else None,
        "description": spec.ring.description,
        "setup": "ring" if layout.cp > 1 else "baseline",
        "layout": layout.sizes(),
        "layout_text": layout.describe(),
        "world_size": layout.world_size,
        "device": device.type, "backend": backend, "dtype": str(dtype).replace("torch.", ""),
        "attention_kernel": attention_kernel,
        "threads_per_rank": torch.get_num_threads(),
        "model": spec.model_summary,
        "workload": spec.ring.workload.model_dump(),
        "metrics": median_metrics(requests),
        "requests": requests,
        "ranks": [{k: v for k, v in r.items() if k not in ("timings", "generated")} for r in ranks],
        "generated": ranks[0]["generated"],
        **(text or {}),
        "started_at": started.isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": _version("deepspeed"), "megatron-core": _version("megatron-core")},
    }


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


@dataclass
class RankSession:
    """One rank's running job (:func:`rank_session`): its process groups, device and runner."""

    rank: int
    groups: ParallelGroups
    device: torch.device
    backend: str
    dtype: torch.dtype
    runner: ModelRunner
    monitor: PeerMonitor


@contextmanager
def rank_session(spec: InferenceSpec, label: str) -> Iterator[RankSession]:
    """Start this rank of a validated ``spec``: the parent watch and the peer monitor (Note [Lost ranks]),
    the default process group, our groups, the runner built for the workload's largest request and handed
    to DeepSpeed. The block serves requests; at its end every rank is done (the monitor told, a barrier).
    The caller writes results and then calls :func:`leave_distributed`.
    """
    ring = spec.ring
    watch_parent(label)  # Note [Orphaned ranks]
    monitor = PeerMonitor(timeout_s=ring.peer_timeout_s).start()
    try:
        device, backend = ds_glue.init_distributed(timeout=timedelta(seconds=ring.collective_timeout_s))
        rank = dist.get_rank()
        monitor.attach(dist.distributed_c10d._get_default_store(), rank, dist.get_world_size())
        groups = init_parallel(spec.layout, timeout=timedelta(seconds=ring.collective_timeout_s))
        dtype = ds_config.torch_dtype(spec.deepspeed)
        work = ring.workload
        runner = runner_module(ring.model.runner).build_runner(
            spec.model, groups, dtype=dtype, device=device, seed=work.seed, batch=work.batch,
            prompt_len=work.prompt_len, new_tokens=work.new_tokens)
        runner.init_deepspeed(spec.deepspeed)
        yield RankSession(rank, groups, device, backend, dtype, runner, monitor)
        monitor.done()
        dist.barrier()
    except Exception:
        monitor.stop_if_lost(wait_s=3 * monitor.interval_s + 1)
        raise


def infer_main(argv: Sequence[str] | None = None) -> int:
    """Run one inference job on this rank; return the exit status."""
    args = parse_args(argv)
    env = ds_glue.launch_env()
    try:
        spec = load_spec(args.config, world_size=env["world_size"], output=args.output)
        check_text_prompts(spec)  # with the tokenizer only: before the model loads (a launcher gave no check)
    except ConfigError as err:
        # Every rank says it: the launcher stops the others as soon as one rank exits.
        print(f"[megatron_ring] rank {env['rank']}: config error, nothing was started:\n{err}", file=sys.stderr,
              flush=True)
        return EXIT_CONFIG
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    with rank_session(spec, f"rank {env['rank']}") as session:
        rank, groups, device, dtype, runner = session.rank, session.groups, session.device, session.dtype, \
            session.runner
        work = spec.ring.workload
        prompt = mask = records = None
        if spec.documents is not None:
            prompt, mask, records = text_prompts(spec.documents, runner.tokenizer, prompt_len=work.prompt_len,
                                                 chat=work.text.chat_template)
        bar = progress((work.warmup + work.repeats) * work.new_tokens, enabled=rank == 0,
                       desc=f"{spec.name} ({spec.layout.describe()})")
        loop = run_requests(runner, batch=work.batch, prompt_len=work.prompt_len, new_tokens=work.new_tokens,
                            warmup=work.warmup, repeats=work.repeats, seed=work.seed, barrier=dist.barrier, bar=bar,
                            prompt=prompt, attention_mask=mask)
        bar.close()
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, _rank_info(rank, groups.coords, device, loop))
    if rank == 0:
        text = None if records is None else {
            "prompts": records, "generated_text": answers(runner.tokenizer, ranks[0]["generated"])}
        result = build_result(spec, ranks, device=device, backend=session.backend, dtype=dtype,
                              attention_kernel=runner.attention_kernel, started=started,
                              wall_s=time.perf_counter() - t0, text=text)
        print(format_table([result]), flush=True)
        if spec.output:
            print(f"[megatron_ring] result written to {write_json_atomic(spec.output, result)}", flush=True)
    leave_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(infer_main())
