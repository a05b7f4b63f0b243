"""The load-memory benchmark's arguments (megatron_ring/perf/bench/load_memory.py); its runs are measured by hand
(docs/inference.md, "Sharded loading")."""
from __future__ import annotations

import pytest

from megatron_ring.perf.bench.load_memory import main, parse_layout


def test_layouts_parse_and_bad_ones_are_named() -> None:
    assert parse_layout("pp2") == {"pp": 2}
    assert parse_layout("tp3pp2") == {"tp": 3, "pp": 2}
    for bad in ("", "pp", "dp2", "tp2x"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(bad)


def test_bad_arguments_exit_2_before_any_rank(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--layouts", "tp2x"])
    assert exit_info.value.code == 2 and "layout 'tp2x'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--runner", "hf", "--ways", "whole"])
    assert exit_info.value.code == 2 and "one way: runner" in capsys.readouterr().err
