"""Memory per rank of the ring: what one call adds above its inputs shrinks with P (Note [Forward memory]
in attention/relay.py).

Measured with the benchmarks' own high-water mark (Note [Peak memory on CPU] in perf/bench/harness.py),
in units of the rank's local q (1 MiB here: 2048 tokens x 2 heads x 64, fp32), so the bounds hold at
every P. A forward call holds its output, one head group's q, two K/V buffers of half the heads and one
kernel's output: about 4.5 local q. Before the relay ran one ring per head group it held 7.3 (P = 2)
to 9.5 (P = 4), with whole copies of q, k, v and two whole receive blocks (this test then fails).
Forward and backward hold about 18 (18-22 before); that bound only guards against regressions.
"""
import pytest

from tests.gloo.memory_workers import ring_call_peak

SEQ_LOCAL, HEADS, HEAD_DIM = 2048, 2, 64
FORWARD_BOUND, FORWARD_BACKWARD_BOUND = 6.0, 24.0


@pytest.mark.parametrize("size", [2, 3, 4])
def test_forward_holds_a_few_local_blocks(gloo_pool, size):
    peaks = gloo_pool(size).run(ring_call_peak, SEQ_LOCAL, HEADS, HEAD_DIM, False)
    assert max(peaks) <= FORWARD_BOUND, f"peak per rank {[round(p, 2) for p in peaks]} local q sizes"


@pytest.mark.parametrize("size", [2, 4])
def test_forward_backward_memory_stays_bounded(gloo_pool, size):
    peaks = gloo_pool(size).run(ring_call_peak, SEQ_LOCAL, HEADS, HEAD_DIM, True)
    assert max(peaks) <= FORWARD_BACKWARD_BOUND, f"peak per rank {[round(p, 2) for p in peaks]} local q sizes"
