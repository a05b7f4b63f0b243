"""The documents of the shipped lm-eval tasks, built offline from local text and sized by the model's own tokenizer.

lm-eval calls these through ``custom_dataset: !function ring_docs.<task>`` with the task's metadata,
which holds ``--model_args`` (``checkpoint``, ``gguf_file``: the tokenizer) and ``--metadata``:

* ``max_seq_lengths``: request lengths in tokens (default 2048, 4096, 8192), each request at most that
  long, its answer included (RULER's name and convention);
* ``depths``: where the fact sits, fractions of the document (default 0, 0.25, 0.5, 0.75, 1);
* ``samples``: documents per (length, depth) (default 1); ``seed`` (default 0);
* ``texts``: folders or files of the haystack (default: the repository's ``data/corpus``, licence texts).

Tasks: ``ring_passkey`` (generate_until: a number hidden at a depth, recalled), ``ring_needle_choice``
(multiple choice by log-likelihood: which of four numbers the text gave), ``ring_corpus_ppl``
(loglikelihood_rolling: the texts cut to each length). Per-length scores follow RULER: a metric per
default length, -1 where a document has another length, left out of the mean.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

DEFAULT_LENGTHS = (2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
ANSWER_TOKENS = 12
"""Tokens kept free after a passkey prompt for the answer (``max_gen_toks`` of ring_passkey.yaml)."""
CHOICES = 4


def _texts(given: Any) -> list[str]:
    """The texts of metadata ``texts`` (files or folders of .txt and .md; default: the repository's data/corpus)."""
    from megatron_ring.datasets.files import corpus_files

    if given is None:
        given = [Path(__file__).resolve().parents[3] / "data" / "corpus"]
    paths = [given] if isinstance(given, (str, Path)) else list(given)
    return [f.read_text(encoding="utf-8", errors="replace")
            for f in corpus_files(paths, (".txt", ".md"), field="metadata texts")]


def _tokenizer(kwargs: dict[str, Any]) -> Any:
    """The tokenizer of ``checkpoint`` (+ ``gguf_file``) from the model arguments."""
    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, resolve_checkpoint

    if not kwargs.get("checkpoint"):
        raise ValueError("the ring_* tasks size their documents with the model's tokenizer: run them with "
                         "--model_args checkpoint=... (or give --metadata '{\"checkpoint\": ...}')")
    return load_tokenizer(resolve_checkpoint(kwargs["checkpoint"]), gguf_file=kwargs.get("gguf_file"))


def _settings(kwargs: dict[str, Any]) -> tuple[list[int], list[float], int, random.Random]:
    lengths = [int(n) for n in kwargs.get("max_seq_lengths", DEFAULT_LENGTHS)]
    depths = [float(d) for d in kwargs.get("depths", DEFAULT_DEPTHS)]
    samples = int(kwargs.get("samples", 1))
    if min(lengths) < 64 or samples < 1 or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"metadata: max_seq_lengths = {lengths} (each >= 64), depths = {depths} (each in [0, 1]), "
                         f"samples = {samples} (>= 1)")
    return lengths, depths, samples, random.Random(int(kwargs.get("seed", 0)))


def _needles(kwargs: dict[str, Any], request_tokens: Callable[[Any, Any], int]) -> Iterator[tuple[Any, Any, int]]:
    """``(tokenizer, NeedleExample, length)`` per (length, depth, sample), each example's whole request
    (``request_tokens(tokenizer, example)``: prompt and answer) at most ``length`` tokens.

    The haystack is measured paragraph by paragraph, and the joined text tokenizes a little
    differently, so an example over its length is drawn again (same random state) on a smaller budget.
    """
    from megatron_ring.datasets.needle import needle_example, paragraphs_of

    tokenizer = _tokenizer(kwargs)
    lengths, depths, samples, rng = _settings(kwargs)
    paragraphs = paragraphs_of(_texts(kwargs.get("texts")))

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    for length in lengths:
        for depth in depths:
            for _ in range(samples):
                state, budget = rng.getstate(), length
                while True:
                    try:
                        example = needle_example(paragraphs, tokens=budget, depth=depth, rng=rng, count_tokens=count)
                    except ValueError as err:
                        raise ValueError(f"metadata max_seq_lengths: {length} tokens are too few for a document, "
                                         f"its question and answer ({err}); give longer lengths") from None
                    over = request_tokens(tokenizer, example) - length
                    if over <= 0:
                        break
                    rng.setstate(state)
                    budget -= over + 4
                yield tokenizer, example, length


def _prompt(example: Any) -> tuple[str, str]:
    """``(text before the answer, the answer's lead-in)``: the document, the question, then the lead-in
    the answer continues ("The special magic number for the <key> is")."""
    lead = f"The special magic number for the {example.key} is"
    return f"{example.document}\n\nQuestion: {example.question}\nAnswer: {lead}", lead


def _dataset(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from datasets import Dataset

    return {"test": Dataset.from_list(list(rows))}


def _tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey(**kwargs: Any) -> dict[str, Any]:
    """ring_passkey: recall the number hidden at each depth of documents of each length."""
    rows = []
    for tokenizer, example, length in _needles(kwargs, lambda tok, ex: _tokens(tok, _prompt(ex)[0]) + ANSWER_TOKENS):
        text, _ = _prompt(example)
        rows.append({"input": text, "value": example.value, "max_length": length, "depth": example.depth,
                     "tokens": _tokens(tokenizer, text)})
    return _dataset(rows)


def needle_choice(**kwargs: Any) -> dict[str, Any]:
    """ring_needle_choice: which of four numbers the document gave (the others drawn alike)."""
    rows = []
    rng = random.Random(int(kwargs.get("seed", 0)) + 1)
    for tokenizer, example, length in _needles(kwargs, lambda tok, ex: _tokens(tok, f"{_prompt(ex)[0]} 000000.") + 2):
        text, _ = _prompt(example)
        choices = [example.value] + [str(rng.randrange(100000, 1000000)) for _ in range(CHOICES - 1)]
        rng.shuffle(choices)
        rows.append({"input": text, "choices": [f" {c}." for c in choices], "gold": choices.index(example.value),
                     "max_length": length, "depth": example.depth})
    return _dataset(rows)


def corpus_text(**kwargs: Any) -> dict[str, Any]:
    """ring_corpus_ppl: each length's worth of the texts (one lm-eval rolling window each), from a drawn start."""
    tokenizer = _tokenizer(kwargs)
    lengths, _, samples, rng = _settings(kwargs)
    ids = tokenizer("\n\n".join(_texts(kwargs.get("texts"))), add_special_tokens=False)["input_ids"]
    rows = []
    for length in lengths:
        take = length - 1  # the rolling window's prefix token comes first
        if take > len(ids):
            raise ValueError(f"metadata max_seq_lengths: {length} tokens, but the texts hold {len(ids)}")
        for _ in range(samples):
            start = rng.randrange(len(ids) - take + 1)
            rows.append({"text": tokenizer.decode(ids[start:start + take]), "max_length": length})
    return _dataset(rows)


def passkey_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``acc`` (the number is in the answer) and the same score under the document's length (RULER's -1 elsewhere)."""
    score = float(doc["value"] in results[0])
    return {"acc": score, **{str(n): score if n == doc["max_length"] else -1.0 for n in DEFAULT_LENGTHS}}


def mean_of_length(scores: list[float]) -> float:
    """Mean over the documents of one length (entries -1 belong to other lengths); -1 when there is none."""
    mine = [s for s in scores if s != -1.0]
    return sum(mine) / len(mine) if mine else -1.0


def corpus_results(doc: dict[str, Any], results: list[float]) -> dict[str, tuple[float, int]]:
    """lm-eval's perplexity metrics of one text (as its wikitext task counts them)."""
    (loglikelihood,) = results
    words, size = len(doc["text"].split()), len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
