"""One rank of ``megatron-ring serve`` (started by torchrun or the deepspeed launcher on every rank).

Rank 0 runs the HTTP server (uvicorn, in a thread) and the rounds' plans; every rank runs the rounds
(Note [Serving in lockstep] in engine.py). SIGTERM or SIGINT to rank 0 drains: new requests get 503,
waiting and running ones finish, then every rank stops. The other ranks ignore both signals and stop
when rank 0 says so (or, if rank 0 is lost, by the peer monitor and the collective timeout).
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as dist

from megatron_ring.config import ConfigError
from megatron_ring.inference.main import EXIT_CONFIG, RankSession, load_spec, rank_session
from megatron_ring.inference.schema import InferenceSpec
from megatron_ring.integrations.deepspeed import process_group as ds_glue
from megatron_ring.parallel.groups import leave_distributed
from megatron_ring.serving.engine import ServeLoop, exchange_plan
from megatron_ring.serving.schema import ServeSection, parse_serve

SERVING_RUNNERS = ("hf", "megatron")
"""Runners whose conversations keep a sharded cache between turns (``start``, ``extend``, ``step``)."""


FLAGS = ("host", "port", "served_model_name", "cache_budget_tokens", "turn_mode")
"""The ``serve`` keys the command's flags override."""


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that override the config's ``serve`` section (shared with the command)."""
    parser.add_argument("--host", default=None, help="bind address (serve.host)")
    parser.add_argument("--port", type=int, default=None, help="port, 0 for any free one (serve.port)")
    parser.add_argument("--served-model-name", default=None, help="the API's model id (serve.served_model_name)")
    parser.add_argument("--cache-budget-tokens", type=int, default=None, help="serve.cache_budget_tokens")
    parser.add_argument("--turn-mode", choices=("auto", "pass_kv", "pass_q"), default=None, help="serve.turn_mode")


def serve_spec(config: str, world_size: int, flags: Optional[argparse.Namespace] = None
               ) -> tuple[InferenceSpec, ServeSection]:
    """The validated config for serving on ``world_size`` ranks and its ``serve`` section with the flags
    applied; ConfigError naming each problem (the workload section is not used: requests are)."""
    spec = load_spec(config, world_size=world_size,
                     workload={"batch": 1, "prompt_len": 2 * world_size, "new_tokens": 2, "text": None})
    where = f"config {config!r}"
    overrides = {key: getattr(flags, key) for key in FLAGS if getattr(flags, key, None) is not None}
    serve = parse_serve({**(spec.ring.serve or {}), **overrides}, where)
    problems, summary = [], spec.model_summary
    if spec.ring.model.runner not in SERVING_RUNNERS:
        problems.append(f"megatron_ring.model.runner = {spec.ring.model.runner!r}: serve keeps conversations in the "
                        f"sharded cache of the {list(SERVING_RUNNERS)} runners only")
    if spec.ring.model.runner == "megatron" and (summary.get("attention") != "ring" or "checkpoint" not in summary):
        problems.append(f"megatron_ring.model: the megatron runner serves a checkpoint (its tokenizer) with attention: "
                        f"ring (its turns run turn_attention); got attention = {summary.get('attention')!r}"
                        + ("" if "checkpoint" in summary else ", random weights"))
    if spec.layout.dp != 1:
        problems.append(f"megatron_ring.layout.dp = {spec.layout.dp}: serve runs one replica; allowed: dp = 1")
    window = window_of(summary)
    if window is None:
        problems.append("megatron_ring.model: the checkpoint does not say its window (max_position_embeddings)")
    for key in ("max_tokens", "max_tokens_limit"):
        value = getattr(serve, key)
        if window is not None and key in serve.model_fields_set and value is not None and value >= window:
            problems.append(f"megatron_ring.serve.{key} = {value}: no request could get that many tokens in the "
                            f"model's window of {window} (its prompt needs one at least); allowed: below {window}")
    if problems:
        raise ConfigError(*problems, where=where)
    return spec, serve


def window_of(summary: dict[str, Any]) -> Optional[int]:
    """The model's window in tokens: a transformers config's ``max_position_embeddings``, a GPT file's ``seq_length``."""
    window = summary.get("max_position_embeddings") or summary.get("seq_length")
    return None if window is None else int(window)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_ring.serving.serve_main")
    parser.add_argument("--config", required=True)
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (unused)")
    add_serve_flags(parser)
    return parser.parse_args(argv)


def serve_main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    env = ds_glue.launch_env()
    try:
        spec, serve = serve_spec(args.config, env["world_size"], args)
    except ConfigError as err:
        print(f"[megatron_ring] rank {env['rank']}: config error, nothing was started:\n{err}", file=sys.stderr,
              flush=True)
        return EXIT_CONFIG
    with rank_session(spec, f"rank {env['rank']}") as session:
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=spec.ring.collective_timeout_s))
        world = dist.get_world_size()
        if session.rank == 0:
            _serve_rank0(spec, serve, session, control, world)
        else:
            session.monitor.on_sigterm = lambda: None  # rank 0 decides when to stop
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            loop = ServeLoop(session.runner, budget_tokens=serve.cache_budget_tokens, turn_mode=serve.turn_mode,
                             emit=lambda *a: None, log=lambda msg: None)
            while not (plan := exchange_plan(None, control, world)).stop:
                loop.run_round(plan)
    leave_distributed()
    return 0


def _serve_rank0(spec: InferenceSpec, serve: ServeSection, session: RankSession, control: Any, world: int) -> None:
    import uvicorn

    from megatron_ring.serving.bridge import Bridge
    from megatron_ring.serving.openai_api import ServedModel, build_app

    runner = session.runner
    tokenizer = runner.tokenizer
    stop_ids = {i for i in (tokenizer.eos_token_id,) if i is not None}
    generation = getattr(runner.module, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    stop_ids |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    window = window_of(spec.model_summary)
    served = ServedModel(serve.served_model_name or spec.name, tokenizer, window, serve.max_tokens,
                         serve.max_tokens_limit or window, tuple(sorted(stop_ids)))
    bridge = Bridge(queue_limit=serve.queue_limit, max_batch=serve.max_batch)
    server = uvicorn.Server(uvicorn.Config(build_app(bridge, served), host=serve.host, port=serve.port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    session.monitor.on_sigterm = bridge.drain
    signal.signal(signal.SIGINT, lambda *_: bridge.drain())
    while not server.started and thread.is_alive():
        threading.Event().wait(0.05)
    if not thread.is_alive():
        raise RuntimeError(f"the HTTP server did not start on {serve.host}:{serve.port} (see the log above)")
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"[megatron_ring] serving {served.name!r} on http://{serve.host}:{port}/v1 ({spec.layout.describe()}, "
          f"window {window} tokens, cache budget {serve.cache_budget_tokens} tokens)", flush=True)
    loop = ServeLoop(runner, budget_tokens=serve.cache_budget_tokens, turn_mode=serve.turn_mode, emit=bridge.emit,
                     log=lambda msg: print(f"[megatron_ring] {msg}", flush=True))
    try:
        while True:
            plan = exchange_plan(bridge.next_plan(len(loop.running), serve.idle_poll_s), control, world)
            if plan.stop:
                break
            loop.run_round(plan)
            bridge.stats = loop.stats()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    print("[megatron_ring] drained and stopped", flush=True)


if __name__ == "__main__":
    sys.exit(serve_main())
