"""One rank of ``megatron-ring niah``: every cell of the grid through one runner, greedy, in lockstep.

Started on every rank by the launcher that ``megatron-ring niah`` runs (it validated everything and
wrote the prompts first)::

    torchrun --nproc_per_node 2 -m megatron_ring.eval.niah_rank --deepspeed_config CONFIG \\
        --prompts OUT/niah_prompts.json

The config's model and layout serve the requests; its workload is replaced by the grid's (one row,
``prompt_len`` the longest cell, ``new_tokens``), so the runner is built once for the longest cell
and serves each cell with :func:`~megatron_ring.inference.loop.run_requests` (no warmup, one
request). Rank 0 decodes the answers, scores them and writes ``niah.json`` and ``heatmap.png``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ring.config import ConfigError
from megatron_ring.eval.niah_report import SCHEMA, format_table, mean_score, score, write_heatmap
from megatron_ring.inference.loop import job_timings, run_requests
from megatron_ring.inference.main import EXIT_CONFIG, RankSession, load_spec, rank_session
from megatron_ring.inference.metrics import RequestTiming
from megatron_ring.inference.prompts import answers
from megatron_ring.inference.schema import InferenceSpec
from megatron_ring.integrations.deepspeed import process_group as ds_glue
from megatron_ring.parallel.groups import leave_distributed
from megatron_ring.runtime.reporting import progress, write_json_atomic


def ids_digest(ids: Sequence[int]) -> str:
    """A short digest of a prompt's ids (two results with the same digest asked the same prompt)."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def serve_cells(session: RankSession, cells: list[dict[str, Any]], new_tokens: int, label: str
                ) -> tuple[list[list[int]], list[RequestTiming]]:
    """Every cell's greedy tokens ``[new_tokens]`` and this rank's timing, in order (every rank)."""
    generated, timings = [], []
    bar = progress(len(cells) * new_tokens, enabled=session.rank == 0, desc=label)
    for cell in cells:
        prompt = torch.tensor([cell["ids"]], dtype=torch.int64)
        loop = run_requests(session.runner, batch=1, prompt_len=prompt.shape[1], new_tokens=new_tokens, warmup=0,
                            repeats=1, seed=0, barrier=dist.barrier, bar=bar, prompt=prompt)
        generated.append(loop.generated[0])
        timings.append(loop.timings[0])
    bar.close()
    return generated, timings


def build_result(spec: InferenceSpec, plan: dict[str, Any], session: RankSession, generated: list[list[int]],
                 timings: list[RequestTiming], *, started: datetime, wall_s: float,
                 load_start: tuple[float, ...]) -> dict[str, Any]:
    """The ``niah.json`` document (rank 0): the run, the grid and every cell."""
    texts = answers(session.runner.tokenizer, generated)
    cells = []
    for cell, ids, text, timing in zip(plan["cells"], generated, texts, timings):
        cells.append({
            "length": cell["length"], "depth": cell["depth"], "tokens": len(cell["ids"]),
            "actual_depth": cell["actual_depth"], "needle_at": cell["needle_at"], "key": cell["key"],
            "expected": cell["value"], "needle": cell["needle"], "question": cell["question"],
            "answer": text, "score": score(text, cell["value"]), "generated_ids": ids,
            "seconds": timing.prefill_s + sum(timing.step_s), "prefill_s": timing.prefill_s,
            "decode_s": sum(timing.step_s), "ids_digest": ids_digest(cell["ids"]),
        })
    layout = spec.layout
    return {
        "schema": SCHEMA, "config": str(spec.path), "name": spec.name, "description": spec.ring.description,
        "layout": layout.sizes(), "layout_text": layout.describe(), "world_size": layout.world_size,
        "runner": spec.ring.model.runner, "model": spec.model_summary,
        "attention_kernel": session.runner.attention_kernel, "device": session.device.type,
        "backend": session.backend, "dtype": str(session.dtype).replace("torch.", ""),
        "threads_per_rank": torch.get_num_threads(), "grid": plan["grid"], "score": mean_score(cells),
        "cells": cells, "started_at": started.isoformat(timespec="seconds"), "wall_s": wall_s,
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "torch": torch.__version__,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron_ring.eval.niah_rank", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_config", "--config", dest="config", required=True, metavar="JSON")
    parser.add_argument("--prompts", required=True, help="the grid and its prompts, written by megatron-ring niah")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def niah_rank_main(argv: Sequence[str] | None = None) -> int:
    """Serve every cell on this rank; rank 0 writes the results next to the prompts file."""
    args = parse_args(argv)
    env = ds_glue.launch_env()
    prompts = Path(args.prompts)
    plan = json.loads(prompts.read_text())
    try:
        spec = load_spec(args.config, world_size=env["world_size"], output=str(prompts.parent / "niah.json"),
                         workload=plan["workload"])
    except ConfigError as err:
        print(f"[niah] rank {env['rank']}: config error, nothing was started:\n{err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    started, t0, load_start = datetime.now(timezone.utc), time.perf_counter(), os.getloadavg()
    new_tokens = plan["workload"]["new_tokens"]
    with rank_session(spec, f"rank {env['rank']}") as session:
        generated, timings = serve_cells(session, plan["cells"], new_tokens, f"niah {spec.layout.describe()}")
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, timings)
    if session.rank == 0:
        result = build_result(spec, plan, session, generated, job_timings(per_rank), started=started,
                              wall_s=time.perf_counter() - t0, load_start=load_start)
        out = prompts.parent
        write_json_atomic(out / "niah.json", result)
        write_heatmap(result, out / "heatmap.png")
        print(format_table(result), flush=True)
    leave_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(niah_rank_main())
