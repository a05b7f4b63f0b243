"""``comm="a2a"`` (Ulysses) and ``"a2a+p2p"`` (hierarchical CP) against the float64 reference on gloo,
forward and backward, and their collectives, bytes and bad input (Note [All-to-all between
sequence and heads] in attention/alltoall.py).

Tolerances as tests/gloo/test_ring_numerics.py: fp32 <= 1e-5, bf16 <= 2e-2 relative Frobenius error.
"""
import itertools
import math

import pytest
import torch

from megatron_ring.testing.gloo import CaseGrid
from tests.gloo import a2a_workers, workers

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEADS = {"mha": (12, 12), "gqa": (12, 4), "mqa": (12, 1), "gqa3": (12, 3)}
"""heads_q 12 splits over 1..4 ranks; heads_kv 4 at P = 3 and 3 at P = 2 or 4 need lcm replication."""
A2A_SIZES = {1: [1], 2: [1, 2], 3: [1, 3], 4: [2, 4]}
"""The a2a group sizes of a2a+p2p tried at each cp (4 = 2 x 2)."""


CAUSAL = [True, False]
SHARDINGS = ["zigzag", "contiguous"]
DTYPES = [torch.float32, torch.bfloat16]


def reference_calls(size, causal, sharding, dtype, heads):
    """``(comm, a2a_size, backend)`` and the worker call of each run of one test_a2a_matches_float64_reference case."""
    heads_q, heads_kv = HEADS[heads]
    runs = [("a2a", None, "sdpa"), ("a2a", None, "math")] + [("a2a+p2p", a, "sdpa") for a in A2A_SIZES[size]]
    return [(run, ((4 * size, heads_q, heads_kv, 8, causal, sharding, run[0], dtype, run[2]), {"a2a_size": run[1]}))
            for run in runs]


@pytest.fixture(scope="module")
def grid(gloo_pool):
    """Every run of test_a2a_matches_float64_reference, one pool call per ring size."""
    return CaseGrid(gloo_pool, workers.ring_vs_reference, {
        size: [call for case in itertools.product(CAUSAL, SHARDINGS, DTYPES, HEADS)
               for _, call in reference_calls(size, *case)] for size in A2A_SIZES})


@pytest.mark.parametrize("size", list(A2A_SIZES))
@pytest.mark.parametrize("causal", CAUSAL, ids=["causal", "full"])
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_a2a_matches_float64_reference(grid, size, causal, sharding, dtype, heads):
    for (comm, a2a_size, backend), (args, kwargs) in reference_calls(size, causal, sharding, dtype, heads):
        for rank, errs in enumerate(grid(size, *args, **kwargs)):
            for name, err in errs.items():
                assert err <= TOL[dtype], f"{comm} a2a={a2a_size} {backend} rank {rank} {name}: {err:.2e}"


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("heads", ["mha", "gqa3"])
def test_a2a_batch_of_one(gloo_pool, size, sharding, heads):
    """Batch 1 with contiguous shards sends and receives views, not copies (Note [All-to-all between
    sequence and heads]); zigzag and the hybrid's ring still copy."""
    heads_q, heads_kv = HEADS[heads]
    for comm, a2a_size in [("a2a", None)] + [("a2a+p2p", a) for a in A2A_SIZES[size]]:
        per_rank = gloo_pool(size).run(workers.ring_vs_reference, 4 * size, heads_q, heads_kv, 8, True, sharding,
                                       comm, torch.float32, "sdpa", batch=1, a2a_size=a2a_size)
        for rank, errs in enumerate(per_rank):
            for name, err in errs.items():
                assert err <= TOL[torch.float32], f"{comm} a2a={a2a_size} rank {rank} {name}: {err:.2e}"


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("comm", ["a2a", "a2a+p2p"])
def test_a2a_key_padding_mask(gloo_pool, size, causal, comm):
    """Left padding, holes and a fully padded row, through the all-to-all and the ring after it."""
    a2a_size = 2 if comm == "a2a+p2p" and size % 2 == 0 else None if comm == "a2a" else 1
    for sharding in ("zigzag", "contiguous"):
        per_rank = gloo_pool(size).run(workers.ring_vs_reference, 4 * size, 12, 4, 8, causal, sharding, comm,
                                       torch.float32, "auto", batch=3, padded=True, a2a_size=a2a_size)
        assert max(max(e.values()) for e in per_rank) <= TOL[torch.float32]


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a", "auto"])
def test_cp_groups_serve_every_comm(gloo_pool, comm):
    """The CPGroups of cp 4 = 2 x 2 passed with a flat comm runs it over its ``cp`` field."""
    per_rank = gloo_pool(4).run(workers.ring_vs_reference, 16, 4, 2, 8, True, "zigzag", comm, torch.float32,
                                "auto", a2a_size=2)
    assert max(max(e.values()) for e in per_rank) <= TOL[torch.float32]


@pytest.mark.parametrize("comm,a2a_size,heads_kv,pieces", [
    ("a2a", 4, 4, 2), ("a2a", 4, 1, 2), ("a2a+p2p", 2, 2, 2), ("a2a+p2p", 2, 1, 2), ("a2a+p2p", 1, 2, 2),
    ("a2a+p2p", 1, 2, None)])
def test_collectives_and_bytes(gloo_pool, comm, a2a_size, heads_kv, pieces):
    """One all-to-all each way per pass under zigzag (q, k, v packed; dq, dk, dv packed); the ring of a2a+p2p
    rotates R - 1 times (in forward once per head group of its K/V heads: ``comm_choice.PIECES`` set to 2, or the cost
    model's choice, whole blocks at these few tokens; Note [Pieces per hop]); bytes sent equal traffic.a2a_bytes."""
    for result in gloo_pool(4).run(a2a_workers.collectives_and_bytes, comm, a2a_size, 4, heads_kv, True, pieces):
        ring = 4 // a2a_size
        a2a_calls = 2 if a2a_size > 1 else 0
        groups = 1 if pieces is None else math.gcd(pieces, math.lcm(heads_kv, a2a_size) // a2a_size)  # ring K/V heads
        assert result["forward"] == {"all_to_all": a2a_calls, "p2p_batches": groups * (ring - 1), "all_gather": 0}, \
            result
        assert result["backward"]["all_to_all"] == a2a_calls, result
        assert result["backward"]["p2p_batches"] == (2 * ring - 1 if ring > 1 else 0), result
        assert result["bytes"] == pytest.approx(result["predicted"]), result


@pytest.mark.parametrize("case,size,error,text", [
    ("heads_not_divisible", 4, "ValueError", "heads_q (6) must be divisible by the cp size (4) for comm='a2a'"),
    ("hybrid_without_groups", 2, "ValueError", "comm='a2a+p2p' needs group=(a2a_group, ring_group)"),
    ("hybrid_causal_differs", 4, "ValueError", "causal differs across the CP group"),
    ("p2p_over_a_bare_tuple", 4, "ValueError", "comm='p2p' needs the whole CP group"),
])
def test_bad_a2a_calls_raise_on_every_rank(gloo_pool, case, size, error, text):
    for rank, (kind, message) in enumerate(gloo_pool(size).run(a2a_workers.outcome, case, timeout_s=60)):
        assert kind == error and text in message, f"rank {rank}: {kind} {message}"


def test_rejected_input_in_one_a2a_group_reaches_every_rank(gloo_pool):
    """Without a flat group the handshake runs over the a2a groups, then the ring groups: rank 3's
    bad dtype makes every rank raise, none waits in a collective."""
    outcomes = gloo_pool(4).run(a2a_workers.outcome, "hybrid_tuple_rejected_on_rank_3", timeout_s=60)
    assert outcomes[3][0] == "TypeError" and "dtype" in outcomes[3][1]
    for rank in (0, 1, 2):
        assert outcomes[rank][0] == "ValueError" and "rejected" in outcomes[rank][1], outcomes[rank]


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a", "a2a+p2p"])
@pytest.mark.parametrize("flat", [True, False], ids=["cp-group", "two-levels"])
def test_decode_from_the_cache_of_every_comm(gloo_pool, comm, flat):
    """The cache after any prefill is the caller's sequence shard (Note [Decode after an all-to-all
    prefill]): decode merges over the CP group, or over the a2a and ring groups, identically on all ranks."""
    for result in gloo_pool(4).run(a2a_workers.prefill_then_decode, comm, 2, flat):
        assert result["prefill"] <= TOL[torch.float32] and result["decode"] <= TOL[torch.float32], result
        assert result["identical"], result
