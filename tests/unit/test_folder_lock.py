"""Output folders owned by one run at a time (Note [Folder locks]): a live owner refuses a second run by
name, a dead owner's lock is taken over, and compare refuses two configs that would write one result."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ring.inference.compare import compare_main
from megatron_ring.runtime.folder_lock import LOCK_FILE, FolderBusy, owned_folder


@pytest.mark.probe
def test_a_live_owner_refuses_a_second_run_and_the_lock_goes_with_the_block(tmp_path: Path) -> None:
    with owned_folder(tmp_path / "out", field="--out-dir") as folder:
        owner = json.loads((folder / LOCK_FILE).read_text())
        with pytest.raises(FolderBusy, match=rf"--out-dir = .*out' is in use by another run \(pid {owner['pid']}"):
            with owned_folder(folder, field="--out-dir"):
                pass
    assert not (tmp_path / "out" / LOCK_FILE).exists()


@pytest.mark.probe
def test_a_dead_owner_is_taken_over_but_another_host_is_not(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "command": "megatron-ring compare"}))
    with owned_folder(tmp_path, field="--out-dir"):
        assert json.loads(lock.read_text())["command"] != "megatron-ring compare"
    lock.write_text(json.dumps({"pid": gone.pid, "host": "elsewhere", "command": "megatron-ring sweep"}))
    with pytest.raises(FolderBusy, match="on elsewhere: 'megatron-ring sweep'.*remove"):
        with owned_folder(tmp_path, field="--out-dir"):
            pass


@pytest.mark.probe
def test_compare_refuses_two_configs_of_one_name_and_a_busy_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "x.json").write_text((root / "cpu_ring_cp4.json").read_text())
    assert compare_main([str(tmp_path / "a" / "x.json"), str(tmp_path / "b" / "x.json"),
                         "--out-dir", str(tmp_path / "out")]) == 2
    assert "both configs are named 'x'" in capsys.readouterr().err
    with owned_folder(tmp_path / "busy", field="--out-dir"):
        assert compare_main(["cpu", "--out-dir", str(tmp_path / "busy")]) == 2
    assert "is in use by another run" in capsys.readouterr().err
