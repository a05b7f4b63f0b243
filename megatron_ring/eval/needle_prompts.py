"""The prompts of a needle-in-a-haystack grid: one needle question per (length, depth) cell, exactly
``length`` tokens through the checkpoint's tokenizer and chat template, no padding.

Each cell's fact comes from :func:`megatron_ring.datasets.needle.needle_example` (a key, a 6-digit value,
a needle sentence at a paragraph boundary of the shipped text); its question goes after the document,
as :func:`megatron_ring.inference.prompts.text_prompts` puts it::

    [template prefix][haystack before ...][needle][... haystack after][\\n\\n question][template suffix]
     head             depth * room tokens  needle  the rest of room      tail

Note [Fitting a needle prompt]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A prompt must be exactly ``length`` tokens: the megatron runner takes no padding, and a padded cell
would not be the length its column says. Paragraphs never add up to an exact token count, so the
haystack is built about twice the room with the needle in its middle (``needle_example`` at depth
0.5), split at the needle, and each side is tokenized and cut token-wise: the haystack before the
needle keeps its last ``round(depth * hay)`` tokens (``hay`` = room minus the needle's tokens), the one
after keeps its first ``hay - that``. The needle's own tokens and sentence are never cut, and it sits at
token depth ``depth`` of the haystack exactly (recorded as ``needle_at``: its first token's position in
the prompt). Should one side of the built haystack be too short for its share (texts short against the
length), the other side gives the difference and the cell records the depth it got (``actual_depth``).
The document's first and last words may be cut mid-word, as in the classic NIAH test (which cuts a
token list too).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

from megatron_ring.datasets.needle import NeedleExample, needle_example, paragraphs_of
from megatron_ring.inference.prompts import template_ids

MIN_HAYSTACK = 16
"""Fewest haystack tokens a cell may have beside its needle (a shorter "haystack" tests nothing)."""


@dataclass(frozen=True)
class NeedleCell:
    """One cell of the grid: its prompt ``ids`` (``length`` token ids), the fact hidden in it and where."""

    length: int
    depth: float
    actual_depth: float
    needle_at: int
    key: str
    value: str
    question: str
    needle: str
    ids: list[int]

    def record(self) -> dict[str, Any]:
        """The cell as JSON (its ids included: the ranks read them)."""
        return asdict(self)


def cell_seed(seed: int, length: int, depth: float) -> int:
    """The seed of one cell's fact and haystack: the same cell gets the same prompt in any grid."""
    return seed * 1_000_003 + length * 1009 + round(depth * 10_000)


def fixed_tokens(tokenizer: Any, *, chat: bool) -> int:
    """Tokens of a cell that are not haystack: template, question and needle (the longest key's), so a
    length must be at least this plus :data:`MIN_HAYSTACK`."""
    key = "northern lantern"
    question = f"What is the special magic number for the {key} mentioned in the text above?"
    head, tail = template_ids(tokenizer, question, chat)
    needle = f"The special magic number for the {key} is 999999."
    return len(head) + len(tail) + len(tokenizer(needle, add_special_tokens=False)["input_ids"])


def haystack(paragraphs: Sequence[str], tokens: Callable[[str], list[int]], *, length: int, seed: int
             ) -> tuple[NeedleExample, list[int], list[int]]:
    """A needle example with its needle in the middle of about ``2 * length`` tokens of haystack, and the
    haystack's tokens before and after the needle: each side at least ``length`` tokens, so that either can
    give any cell's share (Note [Fitting a needle prompt]). Paragraphs long against ``length`` double the
    budget until both sides are long enough (at most 8 times); the fact is drawn from ``seed`` each time."""
    budget = 2 * length
    best: Optional[tuple[NeedleExample, list[int], list[int]]] = None
    for _ in range(8):
        try:
            example = needle_example(paragraphs, tokens=budget, depth=0.5, rng=random.Random(seed),
                                     count_tokens=lambda text: len(tokens(text)))
        except ValueError:  # the first paragraph is longer than the budget
            budget *= 2
            continue
        before_text, after_text = example.document.split(example.answer)
        best = example, tokens(before_text), tokens(after_text)
        if min(len(best[1]), len(best[2])) >= length:
            return best
        budget *= 2
    if best is None:
        raise ValueError(f"--lengths {length}: no paragraph of the texts fits {budget // 2} tokens; give other --texts")
    return best  # the texts are short: the cell takes what there is (its actual_depth says where the needle went)


def needle_cell(paragraphs: Sequence[str], tokenizer: Any, *, length: int, depth: float, seed: int,
                chat: bool) -> NeedleCell:
    """The cell of ``length`` tokens with its needle at ``depth`` (Note [Fitting a needle prompt]);
    ValueError naming ``--lengths`` when ``length`` leaves no room for a haystack."""
    def tokens(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    example, before, after = haystack(paragraphs, tokens, length=length, seed=cell_seed(seed, length, depth))
    head, tail = template_ids(tokenizer, example.question, chat)
    needle = tokens(example.answer)
    hay = length - len(head) - len(tail) - len(needle)
    if hay < MIN_HAYSTACK:
        raise ValueError(f"--lengths {length}: too short for a needle; the chat template, question and needle take "
                         f"{length - hay} tokens, leaving {hay} for the haystack; allowed: lengths >= "
                         f"{length - hay + MIN_HAYSTACK}")
    if len(before) + len(after) < hay:
        raise ValueError(f"--lengths {length}: the texts give {len(before) + len(after)} haystack tokens, fewer "
                         f"than the {hay} a cell needs; give more text (--texts)")
    want_before = round(depth * hay)
    kept_before = min(len(before), max(want_before, hay - len(after)))
    kept_after = hay - kept_before
    ids = head + before[len(before) - kept_before:] + needle + after[:kept_after] + tail
    assert len(ids) == length, (len(ids), length)
    return NeedleCell(length=length, depth=depth, actual_depth=kept_before / hay, needle_at=len(head) + kept_before,
                      key=example.key, value=example.value, question=example.question, needle=example.answer, ids=ids)


def needle_grid(texts: Sequence[str], tokenizer: Any, *, lengths: Sequence[int], depths: Sequence[float],
                seed: int, chat: bool) -> list[NeedleCell]:
    """Every cell of ``lengths x depths`` (lengths outer, depths inner) from ``texts``."""
    paragraphs = paragraphs_of(texts)
    return [needle_cell(paragraphs, tokenizer, length=length, depth=depth, seed=seed, chat=chat)
            for length in lengths for depth in depths]
