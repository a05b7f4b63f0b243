"""The ring hides its transfers behind the block kernels (Note [Overlap and double buffering]).

One process plays rank 0 of a P-rank ring whose transfers are simulated: every posted transfer
takes ``DELAY`` seconds from its post (a sleep in ``wait``, as a transfer in flight would), and
every block kernel takes ``DELAY`` too. Overlapped, a pass costs about one ``DELAY`` per kernel
(the relay's forward runs one per piece of a block, Note [Forward memory]); a transport that waits
for the next transfer before the kernel of the current piece costs one more per transfer.
The bound sits halfway between, so sleep jitter on a busy machine cannot flip the verdict.
Numbers are not checked here (the transfers move nothing): tests/gloo checks them.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
import torch

from megatron_ring.attention import direct, relay, ring
from megatron_ring.attention.call import RingCall, whole_piece
from megatron_ring.attention.call import CPPlace
from megatron_ring.attention.schedule import schedule_for

DELAY = 0.25
P = 4


class _InFlight:
    """A transfer that completes ``DELAY`` seconds after it was posted."""

    def __init__(self) -> None:
        self.done_at = time.perf_counter() + DELAY

    def wait(self) -> bool:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return True


COUNTS = {"kernels": 0, "transfers": 0}


def _post(group: Any, sends: Any, recvs: Any, tag: int, **_: Any) -> list[_InFlight]:
    if not (sends or recvs):
        return []
    COUNTS["transfers"] += 1
    return [_InFlight()]


def _slow(kernel: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        COUNTS["kernels"] += 1
        time.sleep(DELAY)
        return kernel(*args, **kwargs)
    return run


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for module in (relay, direct):
        monkeypatch.setattr(module, "post", _post)
    monkeypatch.setattr(ring, "block_forward", _slow(ring.block_forward))
    monkeypatch.setattr(ring, "block_backward", _slow(ring.block_backward))
    COUNTS.update(kernels=0, transfers=0)
    yield


def _call(window: tuple[int, int]) -> RingCall:
    schedule = schedule_for(0, P, 16, None, causal=False, sharding="contiguous", window=window)
    return RingCall(CPPlace(0, P, None, True, None), "p2p", False, "contiguous", 0.25, "math", False,
                    (whole_piece(schedule, 2, 2),))


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(1, 2, 16, 8) for _ in range(4)]  # q, k, v, dout: [batch, heads, seq_local, head_dim]


@pytest.mark.parametrize("window", [(-1, -1), (40, 40)], ids=["relay", "direct"])
def test_forward_hides_each_transfer_behind_a_kernel(simulated: None, window: tuple[int, int]) -> None:
    call = _call(window)
    steps = sum(1 for plans in call.schedule.plans if plans)
    assert steps == P and call.schedule.sparse == (window != (-1, -1))
    q, k, v, _ = _inputs()
    start = time.perf_counter()
    ring.ring_forward(call, ring.transport_for(call), q, k, v, None)
    wall = time.perf_counter() - start
    assert COUNTS["kernels"] >= steps and COUNTS["transfers"] >= steps - 1
    overlapped, serialised = COUNTS["kernels"] * DELAY, (COUNTS["kernels"] + COUNTS["transfers"]) * DELAY
    assert wall < (overlapped + serialised) / 2, (wall, overlapped, serialised)


@pytest.mark.parametrize("window", [(-1, -1), (40, 40)], ids=["relay", "direct"])
def test_backward_hides_block_and_gradient_transfers_behind_kernels(simulated: None,
                                                                   window: tuple[int, int]) -> None:
    call = _call(window)
    steps = sum(1 for plans in call.schedule.plans if plans)
    q, k, v, dout = _inputs()
    out, lse = ring.ring_forward(call, ring.transport_for(call), q, k, v, None)
    start = time.perf_counter()
    ring.ring_backward(call, ring.transport_for(call), q, k, v, out, lse, dout, None)
    wall = time.perf_counter() - start
    overlapped = (steps + 1) * DELAY  # the last gradient transfer has no kernel after it to hide behind
    serialised = (3 * steps - 1) * DELAY  # block and gradient transfers each waited for before the kernels
    assert wall < (overlapped + serialised) / 2, (wall, overlapped, serialised)
