"""The conversation store (longest prefix, LRU budget) and rank 0's bridge (queue, cancels, drain), no ranks."""
from __future__ import annotations

import pytest

from megatron_ring.serving.bridge import Bridge, Busy
from megatron_ring.serving.conversations import Conversation, ConversationStore
from megatron_ring.serving.engine import GenRequest


def test_a_follow_up_takes_its_conversation_a_shared_prefix_leaves_it():
    store = ConversationStore(budget_tokens=100)
    store.put(Conversation([1, 2, 3, 4], "a"), now=1)
    store.put(Conversation([1, 2, 9], "b"), now=2)
    conv, prefix, whole = store.take([1, 2, 3, 4, 5, 6], now=3)  # extends all of a: a follow-up
    assert (conv.cache, prefix, whole) == ("a", 4, True) and [c.cache for c in store.conversations] == ["b"]
    conv, prefix, whole = store.take([1, 2, 9], now=4)  # all cached: its last token is prefilled again
    assert (conv.cache, prefix, whole) == ("b", 2, False) and conv.last_used == 4
    assert [c.cache for c in store.conversations] == ["b"]  # shared only: b stays, the caller copies the prefix
    assert store.take([7, 8], now=5) == (None, 0, False)


def test_the_budget_evicts_the_least_recently_used():
    store = ConversationStore(budget_tokens=6)
    store.put(Conversation([1, 2, 3], "old"), now=1)
    store.put(Conversation([4, 5, 6], "new"), now=2)
    evicted = store.put(Conversation([7], "newest"), now=3)
    assert [c.cache for c in evicted] == ["old"] and store.tokens() == 4 and store.evicted == 1
    assert [c.cache for c in store.put(Conversation(list(range(10)), "huge"), now=4)] == ["new", "newest", "huge"]


def _request(rid: str) -> GenRequest:
    return GenRequest(rid, [1, 2], 4, [0])


class _Sink:
    def __init__(self) -> None:
        self.events = []

    def put(self, event) -> None:
        self.events.append(event)


def test_bridge_plans_queue_cancel_and_drain():
    bridge = Bridge(queue_limit=2, max_batch=1)
    sinks = {rid: _Sink() for rid in "abc"}
    bridge.submit(_request("a"), sinks["a"])
    bridge.submit(_request("b"), sinks["b"])
    with pytest.raises(Busy, match="queue_limit"):
        bridge.submit(_request("c"), sinks["c"])
    plan = bridge.next_plan(running=0, timeout=0)
    assert [r.rid for r in plan.new] == ["a"] and not plan.stop  # max_batch 1: b waits
    bridge.cancel("b")  # still waiting: dropped here, never planned
    bridge.cancel("a")  # running: cancelled in the next round
    bridge.emit("a", 5, None, {})
    plan = bridge.next_plan(running=1, timeout=0)
    assert plan.new == [] and plan.cancel == ["a"]
    bridge.emit("a", None, "cancelled", {})
    assert [e.finish for e in sinks["a"].events] == [None, "cancelled"] and not sinks["b"].events
    bridge.drain()
    with pytest.raises(Busy, match="shutting down"):
        bridge.submit(_request("c"), sinks["c"])
    assert bridge.next_plan(running=0, timeout=0).stop
