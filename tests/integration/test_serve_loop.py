"""The serving loop (ragged first turns, follow-up turns from the cache, the cache budget) over both runners:
every answer equals transformers generating it in one process from the whole conversation."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from megatron_ring.testing.tiny_hf import save_tiny_model  # noqa: E402
from tests.integration import serve_workers as workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def check(checkpoint: str, per_rank: list[dict[str, Any]], *, cached: bool) -> None:
    first = per_rank[0]
    assert all(r == first for r in per_rank), "ranks disagree"
    for rid, turns in first["turns"].items():
        assert len(turns) == len(workers.conversations()[int(rid[1:])]), rid
        for i, turn in enumerate(turns):
            assert turn["answer"] == workers.alone(checkpoint, turn["prompt"]), (rid, i)
            if i and cached:  # the conversation so far came from the cache, all but the new tokens
                assert turn["cached"] == len(turns[i - 1]["prompt"]) + len(turns[i - 1]["answer"]) - 1, (rid, i)


def test_hf_runner_at_cp3(gloo_pool: Any, checkpoint: str) -> None:
    """Both modes of a turn are checked in test_hf_turns.py; here the loop picks (auto) and decodes together."""
    per_rank = gloo_pool(3).run(workers.serve_conversations, "hf", {"checkpoint": checkpoint}, {"cp": 3}, "auto",
                                10_000, timeout_s=300)
    check(checkpoint, per_rank, cached=True)
    assert per_rank[0]["evicted"] == 0


def test_megatron_runner_at_pp2_cp2(gloo_pool: Any, checkpoint: str) -> None:
    sizes = {"pp": 2, "cp": 2}
    model = {"checkpoint": checkpoint, "dtype": "fp32", "attention": "ring", "parallel": sizes}
    per_rank = gloo_pool(4).run(workers.serve_conversations, "megatron", model, sizes, "auto", 10_000,
                                timeout_s=300)
    check(checkpoint, per_rank, cached=True)


def test_a_small_budget_evicts_and_still_answers_right(gloo_pool: Any, checkpoint: str) -> None:
    """A budget below one conversation: every finished conversation is evicted, every turn prefilled whole."""
    per_rank = gloo_pool(2).run(workers.serve_conversations, "hf", {"checkpoint": checkpoint}, {"cp": 2}, "auto",
                                10, timeout_s=300)
    check(checkpoint, per_rank, cached=False)
    assert per_rank[0]["evicted"] >= 5
    assert all(turn["cached"] == 0 for turns in per_rank[0]["turns"].values() for turn in turns)


@pytest.mark.parametrize("runner", ["hf", "megatron"])
def test_a_shared_prefix_is_copied_and_the_conversation_kept(gloo_pool: Any, checkpoint: str, runner: str) -> None:
    """Note [Follow-up turns by prefix]: a second conversation about the same document copies the document's
    entries; the first conversation keeps its whole cache for its follow-up."""
    model = {"checkpoint": checkpoint} if runner == "hf" else \
        {"checkpoint": checkpoint, "dtype": "fp32", "attention": "ring", "parallel": {"cp": 2}}
    per_rank = gloo_pool(2).run(workers.shared_prefix, runner, model, {"cp": 2}, timeout_s=300)
    first = per_rank[0]
    assert all(r == first for r in per_rank)
    one, two, three = first["prompts"]
    assert first["cached"] == [41, len(one) + len(first["answers"][0]) - 1]
    for prompt, answer in zip(first["prompts"], first["answers"]):
        assert answer == workers.alone(checkpoint, prompt)
    assert first["conversations"] == 2


def test_megatron_runner_with_sequence_parallelism(gloo_pool: Any, checkpoint: str) -> None:
    """tp 2 x cp 2 with sequence_parallel: first turns prefill split over TP, turns and decode run unsplit."""
    sizes = {"tp": 2, "cp": 2}
    model = {"checkpoint": checkpoint, "dtype": "fp32", "attention": "ring",
             "parallel": {**sizes, "sequence_parallel": True}}
    per_rank = gloo_pool(4).run(workers.serve_conversations, "megatron", model, sizes, "auto", 10_000,
                                timeout_s=300)
    check(checkpoint, per_rank, cached=True)
