"""Megatron's RingAttention with LongNet's dilated attention (a layer-spec param, per layer) against
the float64 dilated reference, and its refusals. Workers: tests/integration/megatron_workers.py."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from tests.integration import megatron_workers  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("size", [1, 2])
def test_dilated_layer_matches_reference_and_plain_layer_stays_plain(gloo_pool: Any, size: int) -> None:
    for result in gloo_pool(size).run(megatron_workers.core_attention_dilated_cases):
        for case, err in result["errors"].items():
            assert err <= 1e-5, (case, err)
        assert "dilation does not combine with window_size" in result["refusals"]["window"]
        assert "exceeds heads_q" in result["refusals"]["heads"]
