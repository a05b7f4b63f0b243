"""``megatron-ring check``: every kind of config validated without a rank (training, inference, model YAML);
a bad one exits 2 naming the field, an unknown file names what is accepted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ring.check import check_main

ROOT = Path(__file__).resolve().parents[2]
GOOD = ["configs/deepspeed/train_cp2.json", "configs/deepspeed/train_megatron_pp2_cp2.json",
        "configs/deepspeed/cpu_ring_cp4.json", "configs/megatron/tiny_ring_cp2.yaml", "configs/train/megatron_pp2_cp2.yaml"]


def test_shipped_configs_of_every_kind_pass(capsys: pytest.CaptureFixture) -> None:
    assert check_main([str(ROOT / p) for p in GOOD]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK, ") == len(GOOD)
    assert "training (deepspeed engine), layout tp=1 x cp=2 x dp=2 x pp=1 = 4 on 4 processes" in out
    assert "training (megatron engine)" in out and "inference (megatron runner)" in out
    assert "model: 2 layers, hidden 64, 4 heads" in out
    assert "megatron_pp2_cp2.yaml: OK, training (megatron engine), layout tp=1 x cp=2 x dp=1 x pp=2 = 4 on 4" in out


@pytest.mark.parametrize("source, dotted, value, needle", [
    ("configs/deepspeed/train_cp2.json", ("steps",), "ten", "megatron_ring.steps = 'ten'"),
    ("configs/deepspeed/cpu_ring_cp4.json", ("workload", "batch"), "four", "megatron_ring.workload.batch = 'four'"),
    ("configs/deepspeed/train_cp2.json", ("layout", "tp"), 3, "tp = 3"),
])
def test_a_bad_config_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture, source: str,
                                               dotted: tuple[str, ...], value: object, needle: str) -> None:
    raw = json.loads((ROOT / source).read_text())
    section = raw["megatron_ring"]
    for key in dotted[:-1]:
        section = section[key]
    section[dotted[-1]] = value
    path = tmp_path / Path(source).name
    text = json.dumps(raw).replace('"../../', f'"{ROOT}/').replace('"../', f'"{ROOT}/configs/')
    path.write_text(text)  # relative paths of the shipped file, made absolute
    assert check_main([str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_a_megatron_yaml_takes_its_data_parallel_size_from_the_world(capsys: pytest.CaptureFixture) -> None:
    """Megatron's rule: dp = world / (tp * pp * cp); a world it does not divide names the three sizes. At
    world 8 (dp 2) the global batch of 8 is one micro-batch of 4 per rank, too few for the interleaved schedule."""
    path = str(ROOT / "configs/train/megatron_pp2_cp2.yaml")
    assert check_main([path, "--world", "8"]) == 2
    assert "global_batch_size = 8 gives 1 micro-batches per step" in capsys.readouterr().err
    assert check_main([path, "--world", "6"]) == 2
    assert "world size 6 is not divisible by tensor_model_parallel_size" in capsys.readouterr().err


def test_a_world_other_than_the_layout_and_an_unknown_file_are_refused(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    assert check_main([str(ROOT / "configs/deepspeed/train_cp2.json"), "--world", "8"]) == 2
    assert "does not match the world size 8" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"learning_rate": 4}')
    assert check_main([str(other)]) == 2
    assert "not a config this project reads" in capsys.readouterr().err


def test_megatron_ring_train_refuses_a_bad_config_before_launching(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """``megatron-ring train`` validates for the world it would launch: exit 2 naming the YAML's key, no rank."""
    from megatron_ring.train import train_command

    text = (ROOT / "configs/train/megatron_pp2_cp2.yaml").read_text()
    bad = tmp_path / "train.yaml"
    bad.write_text(text.replace("../megatron/", f"{ROOT}/configs/megatron/").replace("../../", f"{ROOT}/")
                   .replace("context_parallel_size: 2", "context_paralel_size: 2"))
    assert train_command([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "megatron-ring train: error:" in err and "did you mean 'context_parallel_size'" in err
