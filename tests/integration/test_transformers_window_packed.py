"""transformers models with sliding windows and packed documents under the ring: equal single process.

Windowed families with prompts longer than the window (16 tokens, window 6): Mistral
``sliding_window`` (every layer), Qwen2 ``use_sliding_window`` with ``max_window_layers=1`` (layer 1
windowed, layer 0 full), Gemma 2 and Gemma 3 (a sliding layer, then a full one), at cp 2, 3 and 4
(cp 3 left-pads the prompts to a multiple of 6). Logits equal
single-process ``eager`` (fp32 relative error <= 1e-5 on real tokens) and greedy ``generate`` the
same tokens, so decoding from the sharded cache honours the window too. Packed rows (position_ids
restarting per document, as ``DataCollatorWithFlattening`` makes them) give per-document logits
equal to each document run alone.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.pool_family("frameworks")

from megatron_ring.attention.reference import rel_err  # noqa: E402
from megatron_ring.hf import cp_context, ring_forward, ring_generate  # noqa: E402
from megatron_ring.testing.gloo import runs_per_size  # noqa: E402
from megatron_ring.testing.tiny_hf import check_matches_eager, check_refused, sample_prompts, tiny_model  # noqa: E402

TOL = 1e-5
NEW_TOKENS = 6
WINDOW = 6
RUN_TIMEOUT_S = 600

WINDOWED: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW}),
    "gemma3": ("gemma3", {"sliding_window": WINDOW}),
}
DOCS = (7, 3, 11, 1)
"""Document lengths of the packed row (22 tokens): none a multiple of 2·cp, one of a single token."""


def _model(case: str, impl: str):
    family, overrides = WINDOWED[case] if case in WINDOWED else (case, {})
    return tiny_model(family, attn_implementation=impl, **overrides)


def _prompts() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return sample_prompts(seed=2)


def _packed() -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Two packed rows: row 0 holds DOCS, row 1 the same lengths reversed; spans ``(row, start, end)``."""
    gen = torch.Generator().manual_seed(3)
    total = sum(DOCS)
    ids = torch.randint(0, 256, (2, total), generator=gen)
    positions, spans = torch.empty_like(ids), []
    for row, lengths in enumerate((DOCS, DOCS[::-1])):
        start = 0
        for n in lengths:
            positions[row, start:start + n] = torch.arange(n)
            spans.append((row, start, start + n))
            start += n
    return ids, positions, spans


def run_window_cases() -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for case in WINDOWED:
        model = _model(case, "ring")
        for name, (ids, mask) in _prompts().items():
            out[case, name] = (ring_forward(model, ids, mask), ring_generate(model, ids, mask, max_new_tokens=NEW_TOKENS))
    return out


PACKED_CASES = ("llama", "mistral", "gemma3")


def run_packed_cases() -> dict[tuple[str, str], torch.Tensor]:
    ids, positions, _ = _packed()
    out = {}
    for case in PACKED_CASES:
        model = _model(case, "ring")
        out[case, "one row"] = ring_forward(model, ids[:1], position_ids=positions[:1])
        out[case, "two rows"] = ring_forward(model, ids, position_ids=positions)
    return out


@pytest.fixture(scope="module")
def window_results(gloo_pool):
    return runs_per_size(gloo_pool, run_window_cases, RUN_TIMEOUT_S)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("case", list(WINDOWED))
def test_windowed_logits_and_generate_match_eager(window_results, size, case):
    check_matches_eager(_model(case, "eager"), _prompts(), window_results(size), case, f"{case} cp={size}",
                        new_tokens=NEW_TOKENS, tol=TOL)


def test_windowed_models_differ_from_full_attention():
    """The window matters for these prompts: the full-attention model gives other logits and other
    greedy tokens (so a window ignored in prefill or in decode would fail the tests above)."""
    ids = _prompts()["plain"][0]
    for case, (family, overrides) in WINDOWED.items():
        windowed = _model(case, "eager")
        unwindowed = tiny_model(family, attn_implementation="eager", **{**overrides, "sliding_window": 64})
        with torch.no_grad():
            assert rel_err(windowed(ids).logits, unwindowed(ids).logits) > 1e-2, case
        tokens = [m.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[:, -NEW_TOKENS:]
                  for m in (windowed, unwindowed)]
        assert not torch.equal(*tokens), case


@pytest.mark.parametrize("size", [2, 3])
def test_packed_rows_match_each_document_alone(gloo_pool, size):
    per_rank = gloo_pool(size).run(run_packed_cases, timeout_s=RUN_TIMEOUT_S)
    ids, _, spans = _packed()
    for case in PACKED_CASES:
        eager = _model(case, "eager")
        with torch.no_grad():
            alone = {(row, start): eager(ids[row:row + 1, start:end]).logits[0] for row, start, end in spans}
        for rank, results in enumerate(per_rank):
            for key, rows in (("one row", 1), ("two rows", 2)):
                logits = results[case, key]
                assert logits.shape[:2] == (rows, ids.shape[1])
                for row, start, end in spans:
                    if row < rows:
                        err = rel_err(logits[row, start:end], alone[row, start])
                        assert err <= TOL, f"{case} {key} cp={size} rank {rank} doc {row}:{start}-{end}: {err:.2e}"


def test_data_collator_with_flattening_batch_matches_each_document_alone():
    """One process: the batch transformers' DataCollatorWithFlattening builds goes through ring_forward as is."""
    from transformers import DataCollatorWithFlattening

    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in DOCS]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    ring, eager = _model("gemma3", "ring"), _model("gemma3", "eager")
    logits = ring_forward(ring, batch["input_ids"], position_ids=batch["position_ids"])
    start = 0
    with torch.no_grad():
        for doc in docs:
            err = rel_err(logits[0, start:start + len(doc)], eager(doc[None]).logits[0])
            assert err <= TOL, (len(doc), err)
            start += len(doc)


def test_packed_cp_context_is_differentiable():
    """One process: a packed row through cp_context(cu_seqlens=) gives each document's own gradients."""
    from megatron_ring.attention.sharding import shard_sequence

    ring, eager = _model("mistral", "ring"), _model("mistral", "eager")
    lengths = (6, 10)
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    with cp_context(cu_seqlens=cu):
        local = [shard_sequence(t, 0, 1, dim=1, cu_seqlens=cu) for t in (ids, positions)]
        ring(local[0], position_ids=local[1]).logits.square().mean().backward()
    total = torch.zeros(())
    for start, end in ((0, lengths[0]), (lengths[0], sum(lengths))):
        total = total + eager(ids[:, start:end]).logits.square().sum()
    (total / (sum(lengths) * ring.config.vocab_size)).backward()
    for (name, p_ring), p_eager in zip(ring.named_parameters(), eager.parameters()):
        assert rel_err(p_ring.grad, p_eager.grad) <= 1e-4, name


@pytest.mark.parametrize("build, match", [
    (lambda impl: tiny_model("gemma2", attn_implementation=impl, attn_logit_softcapping=50.0),
     r"config.attn_logit_softcapping=50.0 is not supported with ring attention"),
    (lambda impl: tiny_model("gemma3", attn_implementation=impl, use_bidirectional_attention=True),
     r"config.use_bidirectional_attention=True is not supported"),
    (lambda impl: tiny_model("llama", attn_implementation=impl, layer_types=["chunked_attention", "full_attention"]),
     r"config.layer_types contains \['chunked_attention'\]"),
], ids=["gemma2-softcap", "gemma3-bidirectional", "chunked-layers"])
@pytest.mark.parametrize("entry", ["load", "enable_ring_attention", "ring_forward", "ring_generate"])
def test_unsupported_attention_variants_are_refused(build, match, entry):
    """Refused at load with "ring" (Note [Refusing at load]) and, loaded otherwise, at every entry point."""
    check_refused(build, match, entry, _prompts()["plain"][0], 2)


def test_packed_rows_with_padding_are_refused():
    ids, positions, _ = _packed()
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match=r"packed rows .* with padding in attention_mask are not supported"):
        ring_forward(_model("llama", "ring"), ids, mask, position_ids=positions)
