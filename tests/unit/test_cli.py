"""The megatron-ring command line: layout printing, clean errors, delegation."""
from megatron_ring.cli import main


def test_layout_prints_grid_and_groups(capsys):
    assert main(["layout", "--tp", "2", "--cp", "4", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 x cp=4 x dp=1 x pp=2 = 16" in out
    assert "   13   1   2   0   1    11 ->  13 ->  15" in out
    assert "cp groups: [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]" in out


def test_layout_world_mismatch_is_a_clean_error(capsys):
    assert main(["layout", "--tp", "8", "--pp", "2", "--world", "4"]) == 2
    assert "layout world size 16" in capsys.readouterr().err


def test_plan_is_delegated(capsys):
    assert main(["plan", "configs/deepspeed/paper_ring_cp16.json"]) == 0
    assert "KV" in capsys.readouterr().out
