"""Megatron's RingAttention with LongNet's dilated attention (a layer-spec param, per layer) against
the float64 dilated reference, and its refusals. Workers: tests/integration/megatron_workers.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_ring.config import load_mapping  # noqa: E402
from megatron_ring.testing.configs import with_changes  # noqa: E402
from tests.integration import megatron_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "megatron"


@pytest.mark.parametrize("size", [1, 2])
def test_dilated_layer_matches_reference_and_plain_layer_stays_plain(gloo_pool: Any, size: int) -> None:
    for result in gloo_pool(size).run(megatron_workers.core_attention_dilated_cases):
        for case, err in result["errors"].items():
            assert err <= 1e-5, (case, err)
        assert "dilation does not combine with window_size" in result["refusals"]["window"]
        assert "exceeds heads_q" in result["refusals"]["heads"]


def test_model_dilation_reaches_every_ring_layer_with_per_layer_comms(gloo_pool: Any) -> None:
    """``model.dilation`` in a GPT config: every layer's RingAttention gets it, next to its own comm."""
    cfg = with_changes(load_mapping(CONFIGS / "tiny_ring_cp2.yaml"), **{
        "model.dilation": [[8, 1], [16, 2]], "parallel.cp_comm_type": ["p2p", "all_gather"]})
    for layers in gloo_pool(2).run(megatron_workers.dilated_model_layers, cfg):
        assert layers == [(((8, 1), (16, 2)), "p2p"), (((8, 1), (16, 2)), "all_gather")], layers
