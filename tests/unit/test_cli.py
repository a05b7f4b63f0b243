"""The megatron-ring command line: layout printing, help of every subcommand, clean errors, delegation."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron_ring import demo
from megatron_ring.cli import main
from megatron_ring.costs.comm_choice import PROFILE_DIR


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str, str]:
    """Exit status, stdout and stderr of ``megatron-ring ARGV`` run in this process (argparse's exits included)."""
    try:
        code: int | str | None = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test instead of starting torchrun."""
    def launch(cmd: list[str]) -> int:
        raise AssertionError(f"launched {cmd}")
    monkeypatch.setattr("megatron_ring.cli.subprocess.call", launch)


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


@pytest.mark.parametrize("argv, prog, flags", [
    (["layout"], "megatron-ring layout", ["--tp", "--world"]),
    (["demo"], "megatron-ring demo", ["--nproc", "--seq-len", "--heads-kv"]),
    (["plan"], "megatron-ring plan", ["--hardware", "--prompt-len"]),
    (["calibrate"], "megatron-ring calibrate", ["--ranks", "--quick"]),
    (["compare"], "megatron-ring compare", ["--launcher", "--allow-kernel-mismatch"]),
    (["sweep"], "megatron-ring sweep", ["--lengths", "--predict"]),
    (["infer"], "", ["--deepspeed_config", "--output"]),
    (["niah"], "megatron-ring niah", ["--lengths", "--depths", "--new-tokens", "--launcher", "--compare-to"]),
    (["bench"], "megatron-ring bench", ["attention", "numerics"]),
    (["bench", "attention"], "megatron-ring bench attention", ["--L", "--P", "--impl"]),
    (["bench", "numerics"], "megatron-ring bench numerics", ["--L", "--P", "--dtype"]),
    (["bench", "compile"], "megatron-ring bench compile", ["--mode", "--seq", "--repeats"]),
])
def test_every_subcommand_help_shows_its_own_flags(argv, prog, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog}")
    for flag in flags:
        assert flag in out, f"{flag} missing from the help of {argv}:\n{out}"


@pytest.mark.parametrize("argv, message", [
    (["bogus"], "invalid choice: 'bogus'"),
    (["bench", "bogus"], "invalid choice: 'bogus'"),
    ([], "the following arguments are required: command"),
    (["bench"], "the following arguments are required: bench"),
    (["layout", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "--bogus"], "unrecognized arguments: --bogus"),
    (["calibrate", "--bogus"], "unrecognized arguments: --bogus"),
    (["compare", "cpu", "--bogus"], "unrecognized arguments: --bogus"),
    (["sweep", "cpu", "--lengths", "16", "--bogus"], "unrecognized arguments: --bogus"),
    (["infer", "--deepspeed_config", "x.json", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "attention", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "numerics", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "compile", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_unknown_or_missing_subcommand_or_flag_exits_2(argv, message, capsys, no_launch):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err


@pytest.mark.parametrize("argv, message", [
    (["layout", "--tp", "0"], "megatron-ring layout: error: argument --tp: expected an integer >= 1, got 0"),
    (["layout", "--tp", "x"], "megatron-ring layout: error: argument --tp: expected an integer >= 1, got 'x'"),
    (["demo", "--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got 0"),
    (["demo", "--nproc", "0"], "argument --nproc: expected an integer >= 1, got 0"),
    (["demo", "--heads", "-8"], "argument --heads: expected an integer >= 1, got -8"),
    (["demo", "--seq-len", "4097", "--nproc", "2"],
     "megatron-ring demo: error: --seq-len 4097 is not divisible by 2 x 2 ranks = 4: zigzag sharding"),
    (["demo", "--heads", "8", "--heads-kv", "3"],
     "megatron-ring demo: error: --heads 8 is not a multiple of --heads-kv 3"),
    (["bench", "attention", "--L", "0"],
     "megatron-ring bench attention: error: argument --L: expected an integer >= 1, got 0"),
    (["bench", "attention", "--P", "0"], "argument --P: expected an integer >= 1, got 0"),
    (["bench", "attention", "--heads-kv", "-1"], "argument --heads-kv: expected an integer >= 0, got -1"),
    (["bench", "attention", "--timeout", "0"], "argument --timeout: expected a finite number > 0, got 0"),
    (["bench", "attention", "--L", "30", "--P", "4", "--impl", "ring_p2p", "--no-plots", "--out", "/dev/null"],
     "megatron-ring bench attention: error: L = 30 is not divisible by 2*P = 8"),
    (["bench", "numerics", "--L", "0"], "megatron-ring bench numerics: error: argument --L: expected an integer >= 1"),
    (["bench", "numerics", "--P", "1", "3", "--L", "16", "--out", "/dev/null"], "P = 3 gives 2*P = 6"),
    (["bench", "compile", "--seq", "30", "--ranks", "4", "--out", "/dev/null"],
     "megatron-ring bench compile: error: --seq 30 must be a multiple of 2 x ranks = 8 (zigzag sharding)"),
    (["bench", "compile", "--hidden", "100", "--heads", "8", "--out", "/dev/null"],
     "megatron-ring bench compile: error: --hidden 100 must divide by --heads 8"),
    (["plan", "--layers", "0"], "megatron-ring plan: error: argument --layers: expected an integer >= 1, got 0"),
    (["plan", "configs/deepspeed/paper_ring_cp16.json", "--tp", "0"], "argument --tp: expected an integer >= 1, got 0"),
    (["plan", "configs/deepspeed/paper_ring_cp16.json", "--hardware", "nope"],
     "megatron-ring plan: error: hardware profile 'nope' not found"),
    (["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "256", "--batch", "1", "--prompt-len", "16",
      "--kv-heads", "3"],
     "megatron-ring plan: error: model.num_heads = 4 must be a multiple of model.num_kv_heads = 3"),
    (["plan", "configs/deepspeed/paper_ring_cp16.json", "--measured", "/nonexistent/bench.json"],
     "megatron-ring plan: error: --measured '/nonexistent/bench.json': [Errno 2] No such file or directory"),
    (["sweep", "cpu", "--lengths", "0"],
     "megatron-ring sweep: error: argument --lengths: expected an integer >= 1, got 0"),
    (["sweep", "nope", "--lengths", "16"], "megatron-ring sweep: error: unknown pair 'nope'"),
    (["compare", "nope"], "megatron-ring compare: error: unknown pair 'nope'"),
    (["calibrate", "--ranks", "1"],
     "megatron-ring calibrate: error: argument --ranks: expected an integer >= 2, got 1"),
])
def test_bad_values_give_one_line_and_exit_2(argv, message, capsys, no_launch):
    code, _, err = run(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert message in err.strip().splitlines()[-1]


def test_demo_forwards_its_flags_to_torchrun(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    launched: list[list[str]] = []

    def call(cmd: list[str]) -> int:
        launched.append(cmd)
        return 0
    monkeypatch.setattr("megatron_ring.cli.shutil.which", lambda *a, **k: "/bin/torchrun")
    monkeypatch.setattr("megatron_ring.cli.subprocess.call", call)
    assert main(["demo", "--nproc", "2", "--seq-len", "64", "--heads", "4", "--heads-kv", "4", "--head-dim", "8"]) == 0
    (cmd,) = launched
    assert cmd[:5] == ["/bin/torchrun", "--standalone", "--nproc_per_node=2", "-m", "megatron_ring.demo"]
    assert cmd[5:] == ["--seq-len=64", "--heads=4", "--heads-kv=4", "--head-dim=8", "--dtype=float32", "--comm=p2p"]


def test_demo_main_checks_its_flags_before_any_process_group(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process group was started")
    monkeypatch.setattr(demo.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert demo.demo_main(["--seq-len", "4097"]) == 2
    assert "error: --seq-len 4097 is not divisible by 2 x 2 ranks = 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        demo.demo_main(["--seq-len", "0"])
    assert exit_info.value.code == 2
    assert "argument --seq-len: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_plan_dtype_missing_from_the_profile_is_a_clean_error(tmp_path, capsys) -> None:
    profile = json.loads((PROFILE_DIR / "cpu-gloo.json").read_text())
    del profile["peak_flops"]["fp16"]
    path = tmp_path / "no-fp16.json"
    path.write_text(json.dumps(profile))
    code, _, err = run(["plan", "configs/deepspeed/cpu_ring_cp4.json", "--hardware", str(path), "--dtype", "fp16"],
                       capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("megatron-ring plan: error: dtype 'fp16' has no peak_flops")
