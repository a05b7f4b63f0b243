"""One rank's serving loop: every round, rank 0's plan, then the same work on every rank.

Note [Serving in lockstep]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Only rank 0 talks HTTP. Each round it broadcasts a :class:`Plan` (the requests that join, the
ones cancelled, whether to stop) over a CPU group, and every rank then runs the round alike:

1. cancelled requests leave (their conversation is kept, as far as it was fed);
2. new requests whose prompt extends a cached conversation prefill the rest as a turn
   (Note [Follow-up turns by prefix]); the others prefill together in one packed ragged row;
3. every request already running decodes one token, all in one forward where the runner can
   (``step_many``: the hf runner; the megatron runner steps them one by one).

Every rank sees the same plans and computes the same greedy tokens, so requests finish (length,
end of text) in the same round everywhere, and the conversation store decides alike. While
nothing runs, rank 0 sends an empty plan every ``idle_poll_s`` so that the others never wait
in a collective longer than that. A failure in a round (a model error) fails the job on every
rank: the collectives of the round are those of the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_ring.runtime.reporting import return_freed_memory
from megatron_ring.serving.conversations import Conversation, ConversationStore


@dataclass
class GenRequest:
    """A request as every rank sees it: the whole prompt's token ids, greedy, up to ``max_tokens``."""

    rid: str
    tokens: list[int]
    max_tokens: int
    stop_ids: list[int]


@dataclass
class Plan:
    """Rank 0's word for one round (Note [Serving in lockstep])."""

    new: list[GenRequest] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    stop: bool = False


class ConversationRunner(Protocol):
    """What the loop needs of a runner: conversations whose caches it keeps (e.g. ``HFRunner``)."""

    def start(self, documents: list[torch.Tensor]) -> list[tuple[object, int]]: ...
    def extend(self, cache: object, ids: torch.Tensor, mode: str) -> int: ...
    def step(self, cache: object, token: int) -> int: ...
    def fork(self, cache: object, tokens: int) -> object: ...


Emit = Callable[[str, Optional[int], Optional[str], dict], None]
"""``emit(rid, token or None, finish_reason or None, info)``: rank 0's sink of a request's events."""


@dataclass
class Running:
    request: GenRequest
    cache: object
    fed: list[int]
    """Tokens whose K/V are in ``cache``: the prompt, then the answer but its last token."""
    produced: list[int] = field(default_factory=list)


class ServeLoop:
    """The rounds of one rank (Note [Serving in lockstep])."""

    def __init__(self, runner: ConversationRunner, *, budget_tokens: int, turn_mode: str, emit: Emit,
                 log: Callable[[str], None]) -> None:
        self.runner, self.turn_mode, self.emit, self.log = runner, turn_mode, emit, log
        self.store = ConversationStore(budget_tokens)
        self.running: dict[str, Running] = {}
        self.round = 0

    def run_round(self, plan: Plan) -> None:
        self.round += 1
        for rid in plan.cancel:
            if rid in self.running:
                self._finish(self.running.pop(rid), "cancelled")
        fresh, joined = [], []
        for request in plan.new:
            conv, prefix, whole = self.store.take(request.tokens, self.round)
            if conv is None:
                fresh.append(request)
                continue
            start = time.perf_counter()
            cache = conv.cache if whole else self.runner.fork(conv.cache, prefix)
            token = self.runner.extend(cache, torch.tensor(request.tokens[prefix:]), self.turn_mode)
            joined.append((request, cache, token, {"cached_tokens": prefix, "prefill_s": time.perf_counter() - start}))
        if fresh:
            start = time.perf_counter()
            started = self.runner.start([torch.tensor(r.tokens) for r in fresh])
            took = time.perf_counter() - start
            joined += [(r, cache, token, {"cached_tokens": 0, "prefill_s": took}) for r, (cache, token) in zip(fresh, started)]
        stepping = list(self.running.values())
        for request, cache, token, info in joined:
            run = Running(request, cache, list(request.tokens))
            self.running[request.rid] = run
            self._produced(run, token, info)
        if len(stepping) > 1 and hasattr(self.runner, "step_many"):  # one forward for every running request
            tokens = self.runner.step_many([run.cache for run in stepping], [run.produced[-1] for run in stepping])
        else:
            tokens = [self.runner.step(run.cache, run.produced[-1]) for run in stepping]
        for run, token in zip(stepping, tokens):
            self._produced(run, token, {})

    def _produced(self, run: Running, token: int, info: dict) -> None:
        if run.produced:
            run.fed.append(run.produced[-1])
        run.produced.append(token)
        request = run.request
        finish = "stop" if token in request.stop_ids else "length" if len(run.produced) >= request.max_tokens else None
        self.emit(request.rid, token, None, info)
        if finish is not None:
            self._finish(self.running.pop(request.rid), finish)

    def _finish(self, run: Running, reason: str) -> None:
        evicted = [len(conv.tokens) for conv in self.store.put(Conversation(run.fed, run.cache), self.round)]
        for tokens in evicted:
            self.log(f"cache budget: evicted a conversation of {tokens} tokens (least recently used)")
        return_freed_memory()  # the evicted caches are gone now: Note [Freed memory and RSS]
        self.emit(run.request.rid, None, reason, {"evicted": len(evicted), "completion_tokens": len(run.produced)})

    @property
    def idle(self) -> bool:
        return not self.running

    def stats(self) -> dict[str, int]:
        """What the loop holds now: rounds run, requests running, conversations cached and their tokens, evictions."""
        return {"rounds": self.round, "running": len(self.running), "conversations": len(self.store.conversations),
                "cached_tokens": self.store.tokens(), "evicted": self.store.evicted}


def exchange_plan(plan: Plan | None, group: dist.ProcessGroup | None, size: int) -> Plan:
    """Rank 0's ``plan`` on every rank of ``group`` (others pass None)."""
    if size == 1:
        assert plan is not None
        return plan
    box = [plan]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
