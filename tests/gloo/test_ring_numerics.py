"""ring_attention on gloo against a float64 single-process reference, forward and backward.

Tolerances (relative Frobenius error, every output and gradient): fp32 <= 1e-5, bf16 <= 2e-2.
"""
import itertools

import pytest
import torch

from megatron_ring.testing.gloo import CaseGrid
from tests.gloo import workers

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
SIZES = [1, 2, 3, 4]
CAUSAL = [True, False]
SHARDINGS = ["zigzag", "contiguous"]
COMMS = ["p2p", "all_gather"]
DTYPES = [torch.float32, torch.bfloat16]
BACKENDS = ("math", "sdpa")


def reference_call(size, causal, sharding, comm, dtype, heads, backend):
    """The worker call of one case of test_ring_matches_float64_reference."""
    heads_q, heads_kv = HEADS[heads]
    return (4 * size, heads_q, heads_kv, 5, causal, sharding, comm, dtype, backend), {}


def mask_call(size, causal, sharding, comm, dtype, backend):
    """The worker call of one case of test_key_padding_mask_matches_float64."""
    return (4 * size, 4, 2, 8, causal, sharding, comm, dtype, backend), {"batch": 3, "padded": True}


@pytest.fixture(scope="module")
def grid(gloo_pool):
    """Both grids' calls, one pool call per ring size (Note: a case's errors are still asserted by its own test)."""
    calls = {size: [reference_call(size, *case) for case in itertools.product(
        CAUSAL, SHARDINGS, COMMS, DTYPES, HEADS, BACKENDS)] + [mask_call(size, *case) for case in itertools.product(
        CAUSAL, SHARDINGS, COMMS, DTYPES, BACKENDS)] for size in SIZES}
    return CaseGrid(gloo_pool, workers.ring_vs_reference, calls)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("causal", CAUSAL, ids=["causal", "full"])
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
def test_ring_matches_float64_reference(grid, size, causal, sharding, comm, dtype, heads):
    for backend in BACKENDS:
        args, kwargs = reference_call(size, causal, sharding, comm, dtype, heads, backend)
        for rank, errs in enumerate(grid(size, *args, **kwargs)):
            for name, err in errs.items():
                assert err <= TOL[dtype], f"{backend} rank {rank} {name}: rel err {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", ["mha", "mqa"])
def test_all_gather_by_collective_matches_float64_reference(gloo_pool, size, causal, heads):
    """The all-gather collective path (other backends than gloo) computes the same as the pairwise one."""
    heads_q, heads_kv = HEADS[heads]
    per_rank = gloo_pool(size).run(workers.ring_vs_reference_gathering_by_collective, 4 * size, heads_q, heads_kv,
                                   5, causal, "zigzag", "all_gather", torch.float32, "sdpa")
    assert max(max(e.values()) for e in per_rank) <= TOL[torch.float32]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_even_head_dims_and_longer_sequences(gloo_pool, size, head_dim):
    per_rank = gloo_pool(size).run(workers.ring_vs_reference, 24 * size, 8, 2, head_dim, True, "zigzag", "p2p",
                                   torch.float32, "auto", batch=3)
    assert max(max(e.values()) for e in per_rank) <= 1e-5


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("causal", CAUSAL, ids=["causal", "full"])
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_key_padding_mask_matches_float64(grid, size, causal, sharding, comm, dtype):
    """Left padding, random holes and a fully padded row (zero output, zero gradients) over the ring."""
    for backend in BACKENDS:
        args, kwargs = mask_call(size, causal, sharding, comm, dtype, backend)
        for rank, errs in enumerate(grid(size, *args, **kwargs)):
            for name, err in errs.items():
                assert err <= TOL[dtype], f"{backend} rank {rank} {name}: rel err {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_float64_stays_float64(gloo_pool, size, causal, padded):
    """fp64 inputs accumulate and merge in fp64: errors at the 1e-16 level, gradients included."""
    for backend in ("math", "sdpa"):
        per_rank = gloo_pool(size).run(workers.ring_vs_reference, 4 * size, 4, 2, 8, causal, "zigzag", "p2p",
                                       torch.float64, backend, batch=3, padded=padded)
        for rank, errs in enumerate(per_rank):
            for name, err in errs.items():
                assert err <= TOL[torch.float64], f"{backend} rank {rank} {name}: rel err {err:.2e}"


def test_masked_decode_refuses_an_unusable_backend_on_every_rank(gloo_pool):
    for message in gloo_pool(2).run(workers.decode_refuses_a_masked_flash_attn, timeout_s=60):
        assert "backend 'flash_attn' cannot take a key_padding_mask" in message


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_flash_attn_adapter_in_the_ring(gloo_pool, size, causal, sharding):
    """The flash_attn backend's calls inside the ring (views, merged-lse backward, GQA), served by a
    CPU stand-in of the package; the real kernels are checked on a GPU by test_flash_attn_backend."""
    per_rank = gloo_pool(size).run(workers.ring_vs_reference_flash_attn_standin, 4 * size, 4, 2, 16, causal,
                                   sharding, "p2p", torch.bfloat16)
    for rank, errs in enumerate(per_rank):
        for name, err in errs.items():
            assert err <= TOL[torch.bfloat16], f"rank {rank} {name}: rel err {err:.2e}"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("lengths_kind", ["equal", "ragged", "one_empty"])
@pytest.mark.parametrize("heads", ["gqa", "mha"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_matches_reference(gloo_pool, size, lengths_kind, heads, q_len):
    lengths = {"equal": [5] * size, "ragged": [3 + 2 * r for r in range(size)],
               "one_empty": [0] + [4 + r for r in range(size - 1)] if size > 1 else [4]}[lengths_kind]
    heads_q, heads_kv = HEADS[heads]
    for dtype in (torch.float32, torch.bfloat16):
        per_rank = gloo_pool(size).run(workers.decode_vs_reference, lengths, heads_q, heads_kv, 6, q_len, dtype)
        for result in per_rank:
            assert result["err"] <= TOL[dtype], result
            assert result["identical"] and result["dtype"] == dtype and result["shape"] == (2, q_len, heads_q, 6)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("lengths_kind", ["equal", "one_empty"])
def test_decode_with_key_padding_mask(gloo_pool, size, lengths_kind):
    lengths = [6] * size if lengths_kind == "equal" else [0] + [5 + r for r in range(size - 1)] if size > 1 else [5]
    for dtype in (torch.float32, torch.bfloat16):
        per_rank = gloo_pool(size).run(workers.decode_vs_reference, lengths, 4, 2, 8, 2, dtype, batch=3, padded=True)
        for result in per_rank:
            assert result["err"] <= TOL[dtype] and result["identical"], result
