"""The request loop: prefill then decode, timed on every rank, warmup apart.

Every rank runs the same loop on the same prompt (a data-parallel replica serves a copy), so the
runner's collectives line up. A barrier starts each request on all ranks at once; the wall time
of a phase on a rank ends when its runner returns the next ids, which the runner has made
identical on all ranks (the last collective of the step), so per-rank times differ only by the
time to return from that collective. The job's time of a phase is the slowest rank's
(:func:`job_timings`).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_ring.inference.metrics import CommCounter, RequestTiming
from megatron_ring.runtime.reporting import reset_peak_memory
from megatron_ring.inference.runners.protocol import ModelRunner


def make_prompt(batch: int, prompt_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Random prompt ids int64 ``[batch, prompt_len]`` in ``[0, vocab_size)``, the same on every rank."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=gen, dtype=torch.int64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LoopResult:
    """What one rank measured over the measured requests."""

    timings: list[RequestTiming]
    generated: list[list[int]]
    """Token ids ``[batch][new_tokens]`` of the first measured request (greedy)."""
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes this rank sent per request: ``{"prefill": .., "decode": ..}`` (mean over requests)."""
    kv_cache_bytes: int = 0


def run_requests(runner: ModelRunner, *, batch: int, prompt_len: int, new_tokens: int, warmup: int,
                 repeats: int, seed: int, barrier: Callable[[], None], bar: Any,
                 prompt: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None) -> LoopResult:
    """Serve ``warmup + repeats`` identical requests; time and count the last ``repeats``.

    barrier: called before each request on every rank (``torch.distributed.barrier``);
    bar: a progress bar (``update``/``set_postfix_str``), advanced once per prefill and decode step;
    prompt, attention_mask: int64 ``[batch, prompt_len]`` (text prompts, 0 = left padding);
    default: :func:`make_prompt` of ``seed``, no padding.
    """
    device = runner.device
    if prompt is None:
        prompt = make_prompt(batch, prompt_len, runner.vocab_size, seed)
    prompt = prompt.to(device)
    counter = CommCounter()
    timings: list[RequestTiming] = []
    generated: list[list[int]] = []
    for request in range(warmup + repeats):
        measured = request >= warmup
        bar.set_postfix_str(f"{'request' if measured else 'warmup'} "
                            f"{request - warmup + 1 if measured else request + 1}/{repeats if measured else warmup}")
        runner.reset()
        barrier()
        if request == warmup:
            reset_peak_memory(device)
        with counter.active() if measured else nullcontext():
            counter.phase = "prefill"
            _sync(device)
            start = time.perf_counter()
            nxt = runner.prefill(prompt, attention_mask)
            _sync(device)
            timing = RequestTiming(prefill_s=time.perf_counter() - start)
            bar.update(1)
            tokens = [nxt]
            counter.phase = "decode"
            for _ in range(new_tokens - 1):
                start = time.perf_counter()
                nxt = runner.decode(nxt)
                _sync(device)
                timing.step_s.append(time.perf_counter() - start)
                tokens.append(nxt)
                bar.update(1)
            counter.phase = "idle"
        if measured:
            timings.append(timing)
            if not generated:
                generated = torch.stack(tokens, dim=1).tolist()
    return LoopResult(
        timings=timings, generated=generated,
        comm_bytes={phase: counter.total(phase) / repeats for phase in ("prefill", "decode")},
        kv_cache_bytes=runner.kv_cache_bytes(),
    )


def job_timings(per_rank: list[list[RequestTiming]]) -> list[RequestTiming]:
    """Per request and step, the slowest rank's time (``per_rank[rank][request]``)."""
    out = []
    for request in zip(*per_rank):
        out.append(RequestTiming(
            prefill_s=max(t.prefill_s for t in request),
            step_s=[max(steps) for steps in zip(*(t.step_s for t in request))],
        ))
    return out
