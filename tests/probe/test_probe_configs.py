"""Probe sweep, configs: what a user writes wrong is refused before anything starts, naming the field.

Training configs go through ``train_main`` (what ``launch/train.py`` runs on each rank): exit 2,
one message, no process group. Model and inference files go through their loaders.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from megatron_ring.config import ConfigError, load_mapping
from megatron_ring.config.gpt import GPTConfig
from tests.probe.harness import ROOT, assert_clean, train_config

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

MODELS = ROOT / "configs" / "megatron"


def _model_file(tmp: Path, **changes: Any) -> str:
    model = load_mapping(MODELS / "tiny_ring_cp2.yaml")
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        model[section][key] = value
    (tmp / "model.json").write_text(json.dumps(model))
    return str(tmp / "model.json")


def _short_corpus(tmp: Path) -> list[str]:
    (tmp / "short.txt").write_text("tiny")
    return [str(tmp / "short.txt")]


TRAIN: dict[str, tuple[Callable[[Path], Any], list[str]]] = {  # case -> (edit of the raw text or mapping, needles)
    "timeout Infinity": (lambda t: ("text", '"seq_len"', '"collective_timeout_s": Infinity, "seq_len"'),
                         ["megatron_ring.collective_timeout_s = inf", "finite number"]),
    "timeout 1e300": (lambda t: ("set", "collective_timeout_s", 1e300),
                      ["megatron_ring.collective_timeout_s = 1e+300", "less than or equal to 604800"]),
    "peer timeout NaN": (lambda t: ("text", '"seq_len"', '"peer_timeout_s": NaN, "seq_len"'),
                         ["megatron_ring.peer_timeout_s = nan"]),
    "negative peer timeout": (lambda t: ("set", "peer_timeout_s", -1), ["megatron_ring.peer_timeout_s = -1"]),
    "attention dropout 0.1": (lambda t: ("set", "model", _model_file(t, **{"model.attention_dropout": 0.1})),
                              ["model.attention_dropout = 0.1", "allowed: 0.0"]),
    "window with a2a in the model": (lambda t: ("set", "model", _model_file(
        t, **{"model.window_size": [8, 0], "parallel.cp_comm_type": "a2a"})),
        ["model.window_size = [8, 0]", "'a2a'", "allowed with a window"]),
    "corpus shorter than seq_len + 1": (lambda t: ("set", "data", {"kind": "text", "paths": _short_corpus(t)}),
                                        ["tokens (1 files), fewer than megatron_ring.seq_len + 1 = 33"]),
    "duplicate key": (lambda t: ("text", '"seq_len": 32', '"seq_len": 32, "seq_len": 64'),
                      ["gives the key 'seq_len' twice"]),
    "unknown key": (lambda t: ("set", "seq_lenn", 32), ["unknown key 'megatron_ring.seq_lenn'", "did you mean"]),
    "seq_len not positive": (lambda t: ("set", "seq_len", 0), ["megatron_ring.seq_len = 0"]),
    "layout vs world size": (lambda t: ("set", "layout", {"cp": 4}), ["does not match the world size 2"]),
    "string for a bool": (lambda t: ("set", "stop_on_nonfinite_loss", "yes"),
                          ["megatron_ring.stop_on_nonfinite_loss = 'yes'"]),
    "checkpoint dir is a file": (lambda t: ("set", "checkpoint", {"dir": str(ROOT / "README.md")}),
                                 ["megatron_ring.checkpoint.dir", "is a file"]),
    "malformed JSON": (lambda t: ("text", '"seq_len": 32', '"seq_len": 32,,'), ["is not valid JSON", "line 1"]),
    "missing data path": (lambda t: ("set", "data", {"kind": "text", "paths": [str(t / "nowhere")]}),
                          ["data.paths[0]", "does not exist"]),
}


@pytest.mark.parametrize("case", list(TRAIN))
def test_training_config_exits_2_before_anything_starts(case: str, tmp_path: Path, monkeypatch: Any,
                                                        capsys: Any) -> None:
    from megatron_ring.training.loop import EXIT_CONFIG, train_main

    edit, needles = TRAIN[case]
    raw = train_config(tmp_path)
    how, key, value = edit(tmp_path)
    if how == "set":
        raw["megatron_ring"][key] = value
    text = json.dumps(raw)
    if how == "text":
        assert key in text
        text = text.replace(key, value, 1)
    path = tmp_path / "train.json"
    path.write_text(text)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert train_main(["--deepspeed_config", str(path)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert_clean(err)
    for needle in needles:
        assert needle in err, err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("text, needles", [
    ("model: {num_layers: 2}\nmodel: {num_layers: 3}\n", ["key 'model' twice", "line 2"]),
    ("model:\n\tnum_layers: 2\n", ["is not valid YAML", "line 2"]),
], ids=["yaml duplicate key", "yaml tab"])
def test_model_file_errors_name_the_file_and_line(text: str, needles: list[str], tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        GPTConfig.load(tmp_path / "m.yaml")
    for needle in needles + ["m.yaml"]:
        assert needle in str(err.value)


def test_window_on_every_a2a_layer_is_refused_only_where_windowed() -> None:
    base = load_mapping(MODELS / "tiny_ring_cp2.yaml")
    base["model"].update(window_size=[8, 0], window_attn_skip_freq=2)
    base["parallel"].update(cp_comm_type=["p2p", "a2a"])
    assert GPTConfig.parse(base).parallel.comm_types(2) == ["p2p", "a2a"]  # layer 2 attends fully
    base["parallel"].update(cp_comm_type=["a2a", "p2p"])
    with pytest.raises(ConfigError, match="'a2a' on the windowed layers"):
        GPTConfig.parse(base)


def _inference(tmp_path: Path, **ring: Any) -> Path:
    raw = json.loads((ROOT / "configs" / "deepspeed" / "cpu_ring_cp4.json").read_text())
    raw["megatron_ring"].update(ring)
    raw["megatron_ring"]["model"]["config"] = str(ROOT / "configs" / "megatron" / Path(
        raw["megatron_ring"]["model"]["config"]).name)
    path = tmp_path / "infer.json"
    path.write_text(json.dumps(raw))
    return path


def _load_inference(path: Path) -> Any:
    from megatron_ring.inference.main import load_spec

    return load_spec(path, world_size=4)


def test_inference_timeout_infinity_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="megatron_ring.collective_timeout_s = inf"):
        _load_inference(_inference(tmp_path, collective_timeout_s=float("inf")))


def test_inference_timeout_1e300_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        _load_inference(_inference(tmp_path, collective_timeout_s=1e300))


def test_inference_duplicate_key_is_refused(tmp_path: Path) -> None:
    path = _inference(tmp_path)
    path.write_text(path.read_text().replace('"megatron_ring": {', '"megatron_ring": {"layout": {"cp": 2}, ', 1))
    with pytest.raises(ConfigError, match="gives the key 'layout' twice"):
        _load_inference(path)
