"""Needle examples (megatron_ring.datasets.needle): the fact sits at the asked depth, within the token
budget, keys and values follow the seed, and held-out rows train only on the eval pass's first pass."""
from __future__ import annotations

import pytest
import torch

from megatron_ring.datasets.needle import needle_examples, paragraphs_of
from megatron_ring.training.data import PackedSequences, TrainData

TEXT = "\n\n".join(f"Paragraph {i} says something about item {i} and nothing else." for i in range(40))


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_sits_at_its_depth_within_the_budget(depth: float) -> None:
    [example] = needle_examples([TEXT], count=1, tokens=120, seed=3, count_tokens=words, depths=[depth])
    parts = example.document.split("\n\n")
    at = parts.index(example.answer)
    assert abs(at / (len(parts) - 1) - depth) <= 1 / (len(parts) - 1)
    assert words(example.document) <= 120 and len(parts) > 5
    assert example.value in example.answer and example.key in example.question and example.depth == depth
    assert set(example.line()) == {"document", "question", "answer"}


def test_seeds_draw_other_facts_and_depths_spread() -> None:
    a = needle_examples([TEXT], count=4, tokens=80, seed=0, count_tokens=words)
    b = needle_examples([TEXT], count=4, tokens=80, seed=1, count_tokens=words)
    assert [e.depth for e in a] == [0.0, 1 / 3, 2 / 3, 1.0]
    assert [e.value for e in a] != [e.value for e in b]
    assert a == needle_examples([TEXT], count=4, tokens=80, seed=0, count_tokens=words)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no paragraph"):
        paragraphs_of(["  \n\n  "])
    with pytest.raises(ValueError, match="too few"):
        needle_examples([TEXT], count=1, tokens=12, seed=0, count_tokens=words)
    with pytest.raises(ValueError, match="depth = 1.5"):
        needle_examples([TEXT], count=1, tokens=80, seed=0, count_tokens=words, depths=[1.5])


def test_rounds_past_the_last_row_are_masked() -> None:
    """A held-out pass of 3 rows at 2 rows a round: the 4th slot repeats row 0 with loss mask 0."""
    data = TrainData(PackedSequences(torch.arange(30), 9), micro_batch=2, grad_accum=1, dp=1, dp_rank=0, cp=1,
                     cp_rank=0, shuffle=False, seed=0)
    assert len(data.samples) == 3
    first, second = data.step_batches(0, limit=3)[0], data.step_batches(1, limit=3)[0]
    assert first.loss_mask.tolist() == [[1.0] * 9] * 2
    assert second.loss_mask.tolist() == [[1.0] * 9, [0.0] * 9] and second.tokens[1].tolist() == list(range(9))
    assert data.step_batches(1)[0].loss_mask.sum() == 18
