"""The pool hygiene of tests/conftest.py (megatron_ring/testing/hygiene.py): a reset frees what a test
left in a worker, and a module whose workers keep gloo groups is named at the end of the run, which fails."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ring.testing import hygiene
from megatron_ring.testing.gloo import GlooPool
from tests.unit import hygiene_workers

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[2]


def test_reset_frees_groups_and_puts_functional_back() -> None:
    with GlooPool(2, timeout_s=60, setup=hygiene.snapshot) as pool:
        assert pool.run(hygiene_workers.use_groups, 5, False) == [6, 6]
        pool.run(hygiene_workers.replace_linear)
        for after in pool.run(hygiene.reset):
            assert after["groups"] == 1 and after["gloo_threads_added"] == 0, after
        assert pool.run(hygiene_workers.linear_is_torchs) == [True, True]
        pool.run(hygiene_workers.use_groups, 5, True)
        for after in pool.run(hygiene.reset):  # destroyed, but a global still holds them: their threads live
            assert after["groups"] == 1 and after["gloo_threads_added"] >= 5, after


def test_a_leaking_module_is_named_and_fails_the_run(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_leaky="""
        from tests.unit import hygiene_workers

        def test_keeps_groups(gloo_pool):
            gloo_pool(2).run(hygiene_workers.use_groups, 2, True)
    """, test_clean="""
        from tests.unit import hygiene_workers

        def test_frees_groups(gloo_pool):
            gloo_pool(2).run(hygiene_workers.use_groups, 2, False)
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert result.ret == 1
    summary = result.stdout.str().split("pool workers left with threads or process groups (recycled)")[1]
    assert "test_leaky (core pool of 2)" in summary and "test_clean" not in summary
