"""ZeRO-3 trains the ring's Megatron GPT exactly like ZeRO-0, at cp = 1, cp = 2 and tp = 2 x cp = 2.

The cp > 1 layouts need the model partitioned over dp x cp and the loss scaled for ZeRO-3's
reduce-scatter divisor (Note [ZeRO-3 over dp x cp] in megatron_ring/integrations/deepspeed/zero3.py);
without either, the gradient of every weight is 10-50 % off and the run trains to another loss.
Reference: ZeRO-0 at cp = 1 (dp = 4), which the stage 0-2 tests show equal to the other layouts; it
is trained once per test run (shared with test_train_equivalence.py, train_workers.once).
Configs and comparison: tests/integration/test_train_equivalence.py; workers: zero3_workers.py.
"""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("deepspeed")

from tests.integration import zero3_workers  # noqa: E402
from tests.integration.test_train_equivalence import ROOT, assert_same, config, reference  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks"), pytest.mark.slow]


@pytest.fixture(scope="module")
def zero0(gloo_pool: Any) -> dict[str, Any]:
    return reference(gloo_pool(4))


@pytest.mark.parametrize("layout", ["cp1-dp4", "cp2-dp2", "tp2-cp2"])
def test_zero3_trains_like_zero0(gloo_pool: Any, zero0: dict[str, Any], layout: str) -> None:
    results = gloo_pool(4).run(zero3_workers.run_gathered, config(layout, 3), str(ROOT), timeout_s=300)
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks disagree on the step losses"
    assert_same(results[0], zero0, f"{layout} ZeRO-3")
