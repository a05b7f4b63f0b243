"""Needle question/answer documents from local text: a fact hidden at a chosen depth of a long haystack.

Each example is a long-document JSONL line ``{"document": ..., "question": ..., "answer": ...}`` (the
form of ``data.kind: chat`` in training and of ``workload.text.jsonl`` in inference)::

    document: [haystack text ...] The special magic number for the silver harbor is 614207. [... text]
    question: What is the special magic number for the silver harbor mentioned in the text above?
    answer:   The special magic number for the silver harbor is 614207.

The haystack is consecutive paragraphs of the given texts, from a random text and paragraph,
wrapping around, grown until the document reaches ``tokens`` (measured by the caller's
``count_tokens``, e.g. a checkpoint's tokenizer); the needle goes in at a paragraph boundary at
fraction ``depth`` of the document. The key (an adjective and a noun) and the 6-digit value are
drawn from ``seed``, so two calls with different seeds give different facts on the same texts (a
held-out split). Nothing here reads a file or imports a framework.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

ADJECTIVES = ("silver", "quiet", "amber", "northern", "hollow", "crimson", "gentle", "frozen", "golden", "distant",
              "bright", "ancient", "narrow", "velvet", "stormy", "lonely", "copper", "hidden", "wooden", "scarlet")
NOUNS = ("harbor", "lantern", "meadow", "falcon", "bridge", "orchard", "compass", "glacier", "violin", "canyon",
         "teapot", "island", "mirror", "garden", "engine", "river", "castle", "ribbon", "forest", "window")


@dataclass(frozen=True)
class NeedleExample:
    """One example: the long-document JSONL fields, and where the needle sits (``depth`` in [0, 1], the
    fraction of the document's paragraphs before it) and what it says (``key``, ``value``)."""

    document: str
    question: str
    answer: str
    depth: float
    key: str
    value: str

    def line(self) -> dict[str, str]:
        """The JSONL line (``document``, ``question``, ``answer``)."""
        return {k: v for k, v in asdict(self).items() if k in ("document", "question", "answer")}


def paragraphs_of(texts: Sequence[str]) -> list[str]:
    """The non-empty paragraphs (blank-line separated, whitespace inside collapsed) of ``texts``, in order."""
    found = []
    for text in texts:
        for block in text.replace("\r\n", "\n").split("\n\n"):
            words = block.split()
            if words:
                found.append(" ".join(words))
    if not found:
        raise ValueError("the texts hold no paragraph to build a haystack from")
    return found


def needle_example(paragraphs: Sequence[str], *, tokens: int, depth: float, rng: random.Random,
                   count_tokens: Callable[[str], int]) -> NeedleExample:
    """One example of about ``tokens`` tokens (never more, by ``count_tokens``) with its needle at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth = {depth}: allowed 0.0 to 1.0")
    key = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    value = f"{rng.randrange(100000, 1000000)}"
    needle = f"The special magic number for the {key} is {value}."
    question = f"What is the special magic number for the {key} mentioned in the text above?"
    budget = tokens - count_tokens(needle) - 2
    start = rng.randrange(len(paragraphs))
    hay: list[str] = []
    used = 0
    for i in range(len(paragraphs) * 4):  # wraps around the texts; a long target may reuse paragraphs
        paragraph = paragraphs[(start + i) % len(paragraphs)]
        cost = count_tokens(paragraph) + 1
        if used + cost > budget:
            break
        hay.append(paragraph)
        used += cost
    if not hay:
        raise ValueError(f"tokens = {tokens}: too few for a needle and one paragraph of the texts")
    at = round(depth * len(hay))
    document = "\n\n".join(hay[:at] + [needle] + hay[at:])
    return NeedleExample(document, question, needle, depth, key, value)


def needle_examples(texts: Sequence[str], *, count: int, tokens: int, seed: int,
                    count_tokens: Callable[[str], int], depths: Sequence[float] = ()) -> list[NeedleExample]:
    """``count`` examples of about ``tokens`` tokens each from ``texts``; depths cycle through ``depths``
    (default: evenly spread over [0, 1]), keys and values drawn from ``seed``."""
    if count < 1:
        raise ValueError(f"count = {count}: allowed 1 or more")
    rng = random.Random(seed)
    spread = list(depths) or [i / max(count - 1, 1) for i in range(count)]
    paragraphs = paragraphs_of(texts)
    return [needle_example(paragraphs, tokens=tokens, depth=spread[i % len(spread)], rng=rng,
                           count_tokens=count_tokens) for i in range(count)]
