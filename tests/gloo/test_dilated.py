"""Dilated attention (LongNet) on gloo against its float64 reference, forward and backward, P = 1-4;
the traffic it saves against the full ring; ranks that disagree on ``dilation``.

Tolerances as in test_ring_numerics.py: fp32 <= 1e-5, bf16 <= 2e-2 (relative Frobenius error).
"""
import pytest
import torch

from megatron_ring.costs.comm_choice import DEFAULT_COSTS
from megatron_ring.perf.planner.dilated_cost import predict_dilated_point
from tests.gloo import dilated_workers as workers

TOL = {str(torch.float32): 1e-5, str(torch.bfloat16): 2e-2}

# (w, r) sets: w not a multiple of the chunk, a segment longer than the sequence, r not dividing
# heads_q (3 of 4) and the LongNet geometric set.
PAIRS = {"mixed": ((5, 1), (12, 2), (1000, 4)), "odd": ((7, 3),), "longnet": ((4, 1), (8, 2), (16, 4))}
FP32, BF16 = torch.float32, torch.bfloat16
CASES = ((FP32, "p2p", "math"), (FP32, "p2p", "sdpa"), (BF16, "p2p", "sdpa"), (BF16, "p2p", "math"),
         (FP32, "all_gather", "sdpa"), (BF16, "all_gather", "sdpa"))
HEADS = {"gqa": (4, 2), "mqa": (4, 1), "mha": (4, 4)}


def _check(per_rank, what):
    for rank, errors in enumerate(per_rank):
        for (dtype, comm, backend), errs in errors.items():
            for name, err in errs.items():
                assert err <= TOL[dtype], f"{what} rank {rank} {dtype}/{comm}/{backend} {name}: {err:.2e}"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("pairs", list(PAIRS), ids=list(PAIRS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_dilated_matches_float64(gloo_pool, size, pairs, causal, sharding):
    heads = HEADS["gqa"] if pairs != "odd" else HEADS["mqa"]
    per_rank = gloo_pool(size).run(workers.dilated_vs_reference, 12 * size, heads, PAIRS[pairs], causal, sharding,
                                   CASES)
    _check(per_rank, f"{pairs} P={size}")


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
def test_dilated_heads(gloo_pool, size, heads):
    per_rank = gloo_pool(size).run(workers.dilated_vs_reference, 8 * size, HEADS[heads], ((6, 2), (16, 4)), True,
                                   "zigzag", ((FP32, "p2p", "sdpa"),), batch=1)
    _check(per_rank, heads)


def test_dilated_sends_less_than_the_ring(gloo_pool):
    """P = 4, L = 256, LongNet's pairs scaled down: every rank sends at most half the full
    causal ring's bytes, and fewer than the all-gather of the same pattern."""
    pairs = ((32, 1), (64, 2), (128, 4), (256, 8))
    get = gloo_pool(4).run
    ring = get(workers.traffic, 256, (8, 8), None)
    dilated = get(workers.traffic, 256, (8, 8), pairs)
    gathered = get(workers.traffic, 256, (8, 8), pairs, "all_gather")
    assert max(b for _, b in dilated) <= 0.5 * max(b for _, b in ring), (dilated, ring)
    assert max(b for _, b in dilated) < min(b for _, b in gathered), (dilated, gathered)
    point = dict(P=4, L=256, batch=1, heads=8, heads_kv=8, head_dim=8, dtype="fp32", mode="fwd_bwd", causal=True,
                 dilation=pairs)
    for impl, measured in (("ring_p2p", dilated), ("all_gather", gathered)):  # the cost model counts the same bytes
        predicted = predict_dilated_point(point | {"impl": impl}, DEFAULT_COSTS["cpu"])["bytes_sent_max"]
        assert predicted == max(b for _, b in measured), (impl, predicted, measured)


def test_dilated_local_segments_send_nothing(gloo_pool):
    """Segments within one zigzag chunk: no step moves anything."""
    per_rank = gloo_pool(2).run(workers.traffic, 32, (4, 2), ((8, 1), (8, 2)))
    assert all(sent == (0, 0) for sent in per_rank), per_rank


def test_ranks_that_disagree_on_dilation_all_raise(gloo_pool):
    per_rank = gloo_pool(2).run(workers.disagreeing, [((8, 2),), None])
    assert all(err is not None and "dilation differs" in err for err in per_rank), per_rank
    per_rank = gloo_pool(2).run(workers.disagreeing, [((8, 2),), ((8, 9),)])
    assert "exceeds heads_q" in per_rank[1] and "rejected on rank [1]" in per_rank[0], per_rank
