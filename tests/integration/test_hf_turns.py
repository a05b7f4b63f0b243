"""Follow-up turns and ragged first turns of a transformers model over a CP group, against one process."""
from __future__ import annotations

import pytest
import torch

from megatron_ring.attention.reference import rel_err
from megatron_ring.testing.tiny_hf import tiny_model
from tests.integration import hf_turn_workers

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]


def _reference_answers(family: str, overrides: dict) -> list[list[int]]:
    model = tiny_model(family, **overrides)
    document, turns = hf_turn_workers.conversation()
    history, answers = document, []
    for i, (ids, count) in enumerate(turns):
        if i:
            history = torch.cat([history, ids])
        with torch.no_grad():
            out = model.generate(history[None], max_new_tokens=count, do_sample=False, min_new_tokens=count)
        answers.append(out[0, history.numel():].tolist())
        history = out[0]
    return answers


@pytest.mark.parametrize("size,family,overrides", [(3, "llama", {}), (3, "mistral", {"sliding_window": 8})])
def test_follow_up_turns_equal_recomputing_the_conversation(gloo_pool, size, family, overrides):
    """Both modes at an odd ring (cp 2 and "auto": test_serve_loop.py and the launched server)."""
    want = _reference_answers(family, overrides)
    for mode in ("pass_kv", "pass_q"):
        for answers in gloo_pool(size).run(hf_turn_workers.run_conversation, family, mode, overrides):
            assert answers == want, (mode, answers, want)


def test_ragged_documents_in_one_packed_prefill(gloo_pool):
    lengths, count = [5, 23, 40], 4
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    for result in gloo_pool(3).run(hf_turn_workers.run_ragged, lengths, count):
        for doc, answer, logits in zip(docs, result["answers"], result["first_logits"]):
            with torch.no_grad():
                ref = model.generate(doc[None], max_new_tokens=count, do_sample=False, min_new_tokens=count)
                ref_logits = model(doc[None]).logits[0, -1]
            assert answer == ref[0, doc.numel():].tolist()
            assert rel_err(logits, ref_logits) < 1e-5
        # every document's real tokens and answer are kept, none of its padding, split as evenly as zigzag allows
        for doc_index, n in enumerate(lengths):
            shares = [sizes[doc_index] for sizes in result["shard_sizes"]]
            assert sum(shares) == n + count - 1 and max(shares) - min(shares) <= -(-n // 6) * 2 + 1


@pytest.mark.parametrize("family,overrides", [("mistral", {"sliding_window": 8})])
def test_decoding_conversations_together_equals_each_alone(gloo_pool, family, overrides):
    """ring_decode_rows: rows with caches of 5 to 40 tokens (shards of different lengths on every rank) in one
    forward give each conversation the tokens it gets alone, and transformers' on that document."""
    lengths, count = [5, 23, 40], 5
    model = tiny_model(family, **overrides)
    gen = torch.Generator().manual_seed(13)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    for result in gloo_pool(3).run(hf_turn_workers.run_rows, family, overrides, lengths, count):
        assert result["together"] == result["alone"]
        for doc, answer in zip(docs, result["together"]):
            with torch.no_grad():
                ref = model.generate(doc[None], max_new_tokens=count, do_sample=False, min_new_tokens=count)
            assert answer == ref[0, doc.numel():].tolist()


def test_a_dropped_cache_is_freed_at_once():
    """A conversation's RingCache holds no reference cycle, so dropping it frees its K/V at once, without
    Python's cycle collector (a serving rank held every evicted conversation until that collector ran)."""
    import gc
    import weakref

    from megatron_ring.hf import RingCache

    gc.disable()
    try:
        cache = RingCache(2, 0, 1)
        alive = weakref.ref(cache)
        del cache
        assert alive() is None
    finally:
        gc.enable()
