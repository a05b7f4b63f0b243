"""The prepared device check runs its every check on CPU (--cpu-dry-run), as CI runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ring.perf.bench import device_check

ROOT = Path(__file__).resolve().parents[2]
CHECKS = {"kernels", "block_vs_sdpa", "decomposition", "decode", "masked", "two_rank_ring"}


@pytest.mark.launcher
def test_dry_run_writes_every_check_and_passes_its_exactness_targets(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "--cpu-dry-run",
                           "--repeats", "1"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "device_check.json").read_text())
    rows = result["rows"]
    assert {r["check"] for r in rows} == CHECKS
    assert not [r for r in rows if r["ok"] is False]
    exact = [r for r in rows if "err" in r["metric"]]
    assert len(exact) == 17 and all(r["ok"] for r in exact)  # 8 kernels, 4 masked, 4 comms and decode
    assert result["versions"]["cpu_dry_run"] is True
    table = (tmp_path / "device_check.md").read_text().split("\n\n", 1)[1].strip()
    assert "| two_rank_ring | a2a+p2p bf16 causal cp=2 |" in table and table in done.stdout


def test_without_a_gpu_it_asks_for_the_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if device_check.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert device_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device: run on the GPU, or pass --cpu-dry-run" in capsys.readouterr().err


def test_an_unwritable_output_folder_is_refused_before_any_check(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert device_check.main(["--out", str(blocker / "sub"), "--cpu-dry-run"]) == 2
    err = capsys.readouterr()
    assert "is not a writable folder" in err.err and "kernels:" not in err.out


def test_a_failing_check_is_one_failed_row_and_the_rest_still_run(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> list:
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(device_check.checks, "decode", broken)
    rows = device_check.run(tmp_path, True, 1, ["decode", "kernels"])
    failed = [r for r in rows if r["check"] == "decode"]
    assert [(r["case"], r["metric"], r["ok"]) for r in failed] == [("failed", "RuntimeError: kernel exploded", False)]
    assert [r["ok"] for r in rows if r["check"] == "kernels"] == [True] * 8
