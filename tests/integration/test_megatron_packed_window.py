"""Megatron GPT with packed (THD) documents and sliding windows under the ring equals cp = 1.

Packed: one row of documents of mixed lengths (some padded to a multiple of 2·cp, some not),
split per document over the CP group, against every document run alone through the cp = 1
``DotProductAttention`` model: loss, real-token logits and every parameter gradient.
Windowed: ``model.window_size`` (and ``window_attn_skip_freq``) against the windowed cp = 1
``DotProductAttention`` model. Workers: library functions and tests/integration/megatron_workers.py.
"""
from __future__ import annotations

from functools import partial, update_wrapper
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("pydantic")

import torch  # noqa: E402

from megatron_ring.config import load_mapping  # noqa: E402
from megatron_ring.testing.gloo import runs_per_size  # noqa: E402
from megatron_ring.testing.configs import with_changes  # noqa: E402
from tests.integration import megatron_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "megatron"
TOL = 1e-5
DOCS = (20, 5, 27, 12)
"""Padded to 2·cp: cp 2 -> 20, 8, 28, 12 (two padded); cp 4 -> 24, 8, 32, 16 (all padded)."""


def _config(name: str, **changes: Any) -> dict[str, Any]:
    return with_changes(load_mapping(CONFIGS / name), **changes)


PACKED = {
    "cp1-rope": (1, _config("tiny_ring_cp2.yaml", **{"parallel.cp": 1})),
    "cp2-rope-gqa": (2, _config("tiny_ring_cp2.yaml", **{"model.num_query_groups": 2})),
    "cp2-learned-allgather": (2, _config("tiny_ring_cp2.yaml", **{
        "model.position_embedding": "learned_absolute", "parallel.cp_comm_type": "all_gather"})),
    "cp2-rope-window": (2, _config("tiny_ring_cp2.yaml", **{"model.window_size": [6, 0]})),
    "cp4-rope-gqa": (4, _config("tiny_ring_cp4.yaml", **{"model.num_query_groups": 2})),
    "tp2-cp2-rope": (4, _config("tiny_ring_tp2_cp2.yaml")),
}


@pytest.mark.parametrize("case", list(PACKED))
def test_packed_gpt_matches_each_document_alone_at_cp1(compared: Any, case: str) -> None:
    world, _ = PACKED[case]
    for r in megatron_workers.case_results(compared(world), f"packed-{case}"):
        assert r["loss_err"] <= TOL, r
        assert r["logits_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r


WINDOWED = {
    "cp2-rope-window9": (2, _config("tiny_ring_cp2.yaml", **{"model.window_size": [9, 0]})),
    "cp2-rope-window5-skip2-allgather": (2, _config("tiny_ring_cp2.yaml", **{
        "model.window_size": [5, 0], "model.window_attn_skip_freq": 2, "parallel.cp_comm_type": "all_gather"})),
    "cp4-rope-gqa-window13": (4, _config("tiny_ring_cp4.yaml", **{
        "model.window_size": [13, 0], "model.num_query_groups": 2})),
    "cp4-learned-window1": (4, _config("tiny_ring_cp4.yaml", **{
        "model.window_size": [1, 0], "model.position_embedding": "learned_absolute"})),
}


RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def compared(gloo_pool: Any) -> Any:
    """``compared(P)`` -> every rank's ``{case: (ok, result)}`` of the P-rank packed and windowed cases, in one
    pool call per P (megatron_workers.compare_cases: each cp = 1 reference made once, cases grouped by layout)."""
    cases = {**{f"packed-{name}": (world, cfg, DOCS) for name, (world, cfg) in PACKED.items()},
             **{f"windowed-{name}": (world, cfg) for name, (world, cfg) in WINDOWED.items()}}
    run = update_wrapper(partial(megatron_workers.compare_cases, cases), megatron_workers.compare_cases)
    return runs_per_size(gloo_pool, run, RUN_TIMEOUT_S)


@pytest.mark.parametrize("case", list(WINDOWED))
def test_windowed_gpt_matches_cp1_reference(compared: Any, case: str) -> None:
    world, _ = WINDOWED[case]
    results = megatron_workers.case_results(compared(world), f"windowed-{case}")
    for r in results:
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err"] <= TOL, r


def test_windowed_core_attention_equals_dot_product_attention(gloo_pool: Any) -> None:
    for errors in gloo_pool(2).run(megatron_workers.core_attention_window_cp1_cases):
        for case, err in errors.items():
            assert err <= TOL, (case, err)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_thd_core_attention_matches_float64_per_document(gloo_pool: Any, world: int) -> None:
    for errors in gloo_pool(world).run(megatron_workers.thd_core_attention_cases):
        for case, err in errors.items():
            assert err == 0.0 if case.endswith("padding") else err <= TOL, (case, err)


def test_bad_packed_seq_params_are_refused(gloo_pool: Any) -> None:
    refusals = gloo_pool(2).run(megatron_workers.thd_refusals)[0]
    assert "qkv_format = 'sbhd' is not supported by RingAttention; allowed: ['thd']" in refusals["sbhd"]
    assert "cu_seqlens_kv = [0, 8, 16] differs" in refusals["cross"] and "self-attention" in refusals["cross"]
    assert "local_cp_size = 2" in refusals["hybrid"]
    assert "attention_mask must be None with packed_seq_params" in refusals["mask"]
    assert "query must be [t, np, hn]" in refusals["4d_query"]
    assert "cu_seqlens_q = [0, 6, 14] ends at 14 but the CP group holds 16" in refusals["short"]
    assert "does not fit inside cu_seqlens_q_padded = [0, 4, 16]" in refusals["overlong"]
    assert "cu_seqlens_q must be an integer tensor" in refusals["float"]


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_thd_split_is_per_document_zigzag(cp_size: int) -> None:
    """Rank r keeps chunks r and 2P-1-r of every document, in document order (TE's partitioned indices)."""
    from megatron_ring.megatron import get_thd_batch_on_this_cp_rank, pack_documents

    docs = [{"tokens": torch.arange(n) + 100 * i} for i, n in enumerate((5, 12, 1))]
    batch, params = pack_documents(docs, 2 * cp_size, pad={"tokens": -1})
    cu = params.cu_seqlens_q_padded.tolist()
    assert params.cu_seqlens_q.tolist() == [0, 5, 17, 18]
    assert params.max_seqlen_q == max(b - a for a, b in zip(cu, cu[1:]))
    assert batch["loss_mask"][0].tolist() == [float(t >= 0) for t in batch["tokens"][0].tolist()]
    for rank in range(cp_size):
        part = get_thd_batch_on_this_cp_rank(batch, params.cu_seqlens_q_padded, cp_rank=rank, cp_size=cp_size)
        expected = []
        for start, end in zip(cu, cu[1:]):
            chunk = (end - start) // (2 * cp_size)
            for c in (rank, 2 * cp_size - 1 - rank):
                expected += list(range(start + c * chunk, start + (c + 1) * chunk))
        assert part["tokens"][0].tolist() == batch["tokens"][0, expected].tolist()
        assert part["position_ids"][0].tolist() == batch["position_ids"][0, expected].tolist()
