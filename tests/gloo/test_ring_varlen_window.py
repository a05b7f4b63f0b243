"""Sliding windows and packed documents (cu_seqlens) on gloo against float64 references per
document, forward and backward; the traffic the window saves; bad inputs.

Tolerances as in test_ring_numerics.py: fp32 <= 1e-5, bf16 <= 2e-2 (relative Frobenius error).
"""
import pytest
import torch

from tests.gloo import varlen_window_workers as workers

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


def _check(per_rank, dtype, what):
    for rank, (errs, _) in enumerate(per_rank):
        for name, err in errs.items():
            assert err <= TOL[dtype], f"{what} rank {rank} {name}: rel err {err:.2e} > {TOL[dtype]:.0e}"


# (causal, window): Mistral style, a window shorter than a chunk, a two-sided non-causal window,
# a one-sided non-causal window, a window longer than the sequence (the plain path).
WINDOWS = [(True, (5, 0)), (True, (2, 0)), (False, (3, 4)), (False, (-1, 2)), (True, (1000, 0))]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal_window", WINDOWS, ids=[f"{'causal' if c else 'full'}{w}" for c, w in WINDOWS])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_window_matches_float64(gloo_pool, size, causal_window, sharding, dtype):
    causal, window = causal_window
    for comm in ("p2p", "all_gather"):
        for backend in ("math", "sdpa"):
            per_rank = gloo_pool(size).run(workers.ring_vs_reference, 8 * size, 4, 2, 8, causal, window, sharding,
                                           comm, dtype, backend)
            _check(per_rank, dtype, f"{comm}/{backend}")


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_window_with_key_padding_and_gqa(gloo_pool, size, heads, causal):
    """Left padding, random holes and a fully padded row, inside a window."""
    window = (3, 0) if causal else (3, 2)
    for dtype in DTYPES:
        for backend in ("math", "sdpa"):
            per_rank = gloo_pool(size).run(workers.ring_vs_reference, 8 * size, *heads, 8, causal, window, "zigzag",
                                           "p2p", dtype, backend, batch=3, padded=True)
            _check(per_rank, dtype, backend)


DOCS = {"mixed": [4, 12, 2, 6], "one": [8], "long_short": [14, 2]}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("docs", list(DOCS), ids=list(DOCS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_varlen_matches_float64_per_document(gloo_pool, size, docs, causal, dtype):
    """Documents of mixed lengths (multiples of 2*cp), each attended on its own."""
    lengths = [n * size for n in DOCS[docs]]
    for comm in ("p2p", "all_gather"):
        for backend in ("math", "sdpa"):
            per_rank = gloo_pool(size).run(workers.ring_vs_reference, 0, 4, 2, 8, causal, (-1, -1), "zigzag", comm,
                                           dtype, backend, doc_lengths=lengths)
            _check(per_rank, dtype, f"{comm}/{backend}")


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal_window", [(True, (3, 0)), (False, (2, 5))], ids=["causal", "full"])
def test_varlen_with_window_gqa_and_padding(gloo_pool, size, sharding, causal_window):
    causal, window = causal_window
    lengths = [n * size for n in (4, 12, 2, 6)]
    for dtype in DTYPES:
        for padded in (False, True):
            per_rank = gloo_pool(size).run(workers.ring_vs_reference, 0, 4, 1, 8, causal, window, sharding, "p2p",
                                           dtype, "sdpa", doc_lengths=lengths, padded=padded)
            _check(per_rank, dtype, f"padded={padded}")


def test_window_moves_less_than_the_full_ring(gloo_pool):
    """P = 4, L = 64, causal: a window of one zigzag chunk (L/8) sends at most 0.4x the bytes of the
    full causal ring on every rank; contiguous sharding stops after one step."""
    pool = gloo_pool(4)
    full = pool.run(workers.traffic, 64, (-1, -1), "zigzag")
    window = pool.run(workers.traffic, 64, (7, 0), "zigzag")
    for (_, full_bytes), (_, window_bytes) in zip(full, window):
        assert window_bytes <= 0.4 * full_bytes, (window_bytes, full_bytes)
    contiguous = pool.run(workers.traffic, 64, (7, 0), "contiguous")
    # forward: rank r < 3 sends its rows once (to r + 1); backward: the same rows, then the gradient back
    assert [steps for steps, _ in contiguous] == [2, 3, 3, 1]


def test_packed_documents_move_no_more_than_one_long_sequence(gloo_pool):
    """Packing changes what is computed, not what moves: the same bytes as one sequence of the same length."""
    pool = gloo_pool(3)
    packed = pool.run(workers.traffic, 48, (-1, -1), "zigzag", doc_lengths=[12, 6, 24, 6])
    plain = pool.run(workers.traffic, 48, (-1, -1), "zigzag")
    for (_, packed_bytes), (_, plain_bytes) in zip(packed, plain):
        assert packed_bytes <= plain_bytes


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [(4, 0), (0, 0), (2, 3), (-1, 0)])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_decode_with_window(gloo_pool, size, window, padded):
    """A round-robin cache (positions not contiguous per rank), queries at the end of the sequence."""
    for dtype in DTYPES:
        for q_len in (1, 3):
            for result in gloo_pool(size).run(workers.decode_window_vs_reference, 6 * size + 1, window, 4, 2, q_len,
                                              dtype, padded=padded, batch=3 if padded else 2):
                assert result["err"] <= TOL[dtype] and result["identical"], result


BAD = {
    "cu_int64": "ValueError: cu_seqlens.dtype is torch.int64; allowed: torch.int32",
    "cu_not_monotone": "ValueError: cu_seqlens must be non-decreasing",
    "cu_wrong_total": "ValueError: cu_seqlens[-1] =",
    "cu_not_divisible": "ValueError: cu_seqlens: document 0 has",
    "cu_4d": "ValueError: with cu_seqlens, q must be packed 3-D",
    "window_negative": "ValueError: window_size must be a pair (left, right) of ints >= -1",
    "window_not_pair": "ValueError: window_size must be a pair",
    "window_on_one_rank": "ValueError: ring_attention: window_size[0] differs across the CP group",
    "cu_on_one_rank": "ValueError: ring_attention: cu_seqlens differs across the CP group",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_window_and_cu_seqlens(gloo_pool, kind):
    """Every rank raises (a rank with bad input its own error, the others through the handshake)."""
    messages = gloo_pool(2).run(workers.bad_call, kind, timeout_s=60)
    assert all(m.startswith(BAD[kind]) for m in messages), messages


def test_bench_attention_window_and_docs_variants(gloo_pool):
    """``bench attention --window --docs``: every variant runs, and the window sends fewer bytes."""
    from megatron_ring.perf.bench.attention import run_attention_bench

    points = run_attention_bench(lengths=[64], ranks=[2], impls=["single", "ring_p2p"], modes=["fwd_bwd"],
                                 causals=[True], batch=1, heads=2, heads_kv=1, head_dim=8, dtype="fp32", repeats=1,
                                 warmup=0, backend="auto", progress=lambda *_: None,
                                 pools=lambda size, threads: gloo_pool(size), own_sessions=False, window="L/8", docs=4)
    ring = {p["variant"]: p for p in points if p["impl"] == "ring_p2p"}
    assert set(ring) == {"", "window=8", "packed 4 docs", "4 docs one by one"}
    assert ring["window=8"]["bytes_sent_max"] < ring[""]["bytes_sent_max"]
    assert {p["variant"] for p in points if p["impl"] == "single"} == set(ring)
    with pytest.raises(ValueError, match="--window must be a positive number of tokens or 'L/k'"):
        run_attention_bench(lengths=[64], ranks=[2], impls=["ring_p2p"], modes=["fwd"], causals=[True], batch=1,
                            heads=2, heads_kv=1, head_dim=8, dtype="fp32", repeats=1, warmup=0, backend="auto",
                            window="L/0")
    with pytest.raises(ValueError, match="--docs 3"):
        run_attention_bench(lengths=[64], ranks=[2], impls=["ring_p2p"], modes=["fwd"], causals=[True], batch=1,
                            heads=2, heads_kv=1, head_dim=8, dtype="fp32", repeats=1, warmup=0, backend="auto", docs=3)
