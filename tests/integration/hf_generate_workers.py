"""Generation cases for ``ring_generate`` (run on every rank of a gloo pool) and their single-process references.

Every case is ``(prompt, generate kwargs, seed)``; its kwargs are built fresh per call because logits
processors and stopping criteria are objects. The tiny Llama's prompts: ``padded`` (13 tokens, not a
multiple of ``2 * cp``, row 1 left-padded by 5), ``plain`` (16 tokens, no mask) and ``one`` (1 token:
after the prefill every rank's cache shard is empty).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer, TextStreamer

from megatron_ring.hf import ring_generate
from megatron_ring.testing.tiny_hf import byte_tokenizer, sample_prompts, tiny_model

NEW_TOKENS = 4
BANNED = 7  # a token id the custom logits processor forbids


def prompts() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    base = sample_prompts(seed=1)
    return {**base, "one": (base["plain"][0][:, :1], None)}


class BanToken(LogitsProcessor):
    """Forbids :data:`BANNED` and records the sequence lengths it was called with (the unpadded ones)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.lengths.append(input_ids.shape[1])
        return scores.index_fill(1, torch.tensor([BANNED]), float("-inf"))


class StopAtLength(StoppingCriteria):
    """Stops every row once the sequence (prompt included) reaches ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class Collect(BaseStreamer):
    """Keeps every ``put`` (the prompt first, then one ``[batch]`` token tensor per step) and counts ``end``."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


class TextCollect(TextStreamer):
    """transformers' ``TextStreamer`` writing into a list instead of stdout."""

    def __init__(self) -> None:
        super().__init__(byte_tokenizer(), skip_prompt=True)
        self.text: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text.append(text)


CASES: dict[str, tuple[str, Callable[[], dict[str, Any]], int]] = {
    "greedy": ("padded", lambda: {}, 0),
    "greedy-plain": ("plain", lambda: {}, 0),
    "beams2": ("padded", lambda: {"num_beams": 2}, 0),
    "beams4": ("padded", lambda: {"num_beams": 4, "num_return_sequences": 2}, 0),
    "beams4-plain": ("plain", lambda: {"num_beams": 4, "length_penalty": 0.5}, 0),
    "beams2-one-token": ("one", lambda: {"num_beams": 2}, 0),
    "sample-top-k": ("padded", lambda: {"do_sample": True, "top_k": 20, "temperature": 0.8}, 11),
    "sample-top-p": ("padded", lambda: {"do_sample": True, "top_p": 0.9, "temperature": 1.5,
                                        "num_return_sequences": 2}, 12),
    "sample-beams2": ("padded", lambda: {"do_sample": True, "num_beams": 2, "top_k": 50}, 13),
    "no-cache-greedy": ("padded", lambda: {"use_cache": False}, 0),
    "no-cache-beams2": ("padded", lambda: {"use_cache": False, "num_beams": 2}, 0),
    "no-cache-sample": ("padded", lambda: {"use_cache": False, "do_sample": True, "top_p": 0.8}, 14),
    "processors": ("padded", lambda: {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2,
                                      "logits_processor": LogitsProcessorList([BanToken()]),
                                      "stopping_criteria": StoppingCriteriaList([StopAtLength(13 + 3)])}, 0),
}
"""name -> (prompt, kwargs factory, seed). Lengths 13 + 3 stop the ``processors`` case one token early."""


def generate(model: torch.nn.Module, name: str, ring: bool) -> torch.Tensor:
    """Case ``name`` through ``ring_generate`` (``ring``) or single-process ``model.generate``."""
    prompt, make_kwargs, seed = CASES[name]
    ids, mask = prompts()[prompt]
    kwargs = {"max_new_tokens": NEW_TOKENS, **make_kwargs()}
    torch.manual_seed(seed)
    if ring:
        return ring_generate(model, ids, mask, **kwargs)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **kwargs)


def sampled_logits(model: torch.nn.Module, ring: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences, per-step logits ``[steps, batch, vocab]``) of a seeded top-k sample of the padded prompt."""
    ids, mask = prompts()["padded"]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20, return_dict_in_generate=True,
                  output_logits=True)
    torch.manual_seed(21)
    if ring:
        out = ring_generate(model, ids, mask, **kwargs)
    else:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kwargs)
    return out.sequences, torch.stack(out.logits)


def streamed(model: torch.nn.Module, ring: bool, on_this_rank: bool) -> dict[str, Any]:
    """Row 0 of the padded prompt with a ``Collect`` and a ``TextCollect`` streamer (only where ``on_this_rank``)."""
    ids = prompts()["padded"][0][:1]
    collect, text = (Collect(), TextCollect()) if on_this_rank else (None, None)
    out = {}
    for key, streamer in (("collect", collect), ("text", text)):
        out[key + "_tokens"] = (ring_generate(model, ids, max_new_tokens=NEW_TOKENS, streamer=streamer) if ring else
                                model.generate(ids, max_new_tokens=NEW_TOKENS, streamer=streamer))
    if on_this_rank:
        out.update(puts=collect.puts, ended=collect.ended, text="".join(text.text))
    return out


def run_generation_cases() -> dict[str, Any]:
    """On every rank (world = CP group): every case, the sampled logits, the streamers (rank 0 only) and the
    error of sampling with a different seed on each rank."""
    model = tiny_model("llama", attn_implementation="ring")
    out: dict[str, Any] = {name: generate(model, name, ring=True) for name in CASES}
    out["sampled_logits"] = sampled_logits(model, ring=True)
    out["streamed"] = streamed(model, ring=True, on_this_rank=dist.get_rank() == 0)
    processor = BanToken()
    ids, mask = prompts()["padded"]
    ring_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, logits_processor=LogitsProcessorList([processor]))
    out["processor_lengths"] = processor.lengths
    torch.manual_seed(100 + dist.get_rank())
    try:
        ring_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True)
        out["seed_error"] = None
    except ValueError as err:
        out["seed_error"] = str(err)
    return out


def mismatched_generate(change: str) -> str | None:
    """``ring_generate`` where rank 1 changes ``change`` ("prompt": other ids of the same shape;
    "max_new_tokens": one more token); this rank's error, or None if it returned."""
    model = tiny_model("llama", attn_implementation="ring")
    ids, mask = prompts()["padded"]
    new_tokens = NEW_TOKENS
    if dist.get_rank() == 1:
        ids = ids.flip(-1) if change == "prompt" else ids
        new_tokens += int(change == "max_new_tokens")
    try:
        ring_generate(model, ids, mask, max_new_tokens=new_tokens)
    except ValueError as err:
        return str(err)
    return None
