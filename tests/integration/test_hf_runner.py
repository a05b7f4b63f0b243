"""The hf runner (a transformers checkpoint; TP by DeepSpeed AutoTP, CP by the ring) on gloo.

A tiny random Llama written by transformers into the test's directory: greedy tokens of a
left-padded batch at cp 2, cp 4, tp 2 and tp 2 x cp 2 equal single-process ``generate`` (fp32),
and AutoTP really shards the weights (half the query rows per TP rank).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from megatron_ring.testing.tiny_hf import PAD_ID, save_tiny_model  # noqa: E402
from tests.integration import hf_runner_workers as workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]
NEW_TOKENS = 6
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 16 tokens, row 1 left-padded by 5."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5], ids[1, :5] = 0, PAD_ID
    return ids, mask


@pytest.mark.parametrize("layout", [{"cp": 2}, {"cp": 4}, {"tp": 2}, {"tp": 2, "cp": 2}],
                         ids=["cp2", "cp4", "tp2", "tp2xcp2"])
def test_hf_runner_matches_generate(gloo_pool, checkpoint, layout):
    ids, mask = padded_batch()
    expected = workers.reference(checkpoint, ids, mask, NEW_TOKENS)
    world = layout.get("tp", 1) * layout.get("cp", 1)
    per_rank = gloo_pool(world).run(workers.serve, {"checkpoint": checkpoint}, layout, ids, mask, NEW_TOKENS,
                                    timeout_s=TIMEOUT_S)
    rows = 64 // layout.get("tp", 1)  # hidden 64 = 4 heads x 16
    for rank, (tokens, q_rows) in enumerate(per_rank):
        assert torch.equal(tokens, expected), f"{layout} rank {rank}: {tokens.tolist()} != {expected.tolist()}"
        assert q_rows == rows, f"{layout} rank {rank}: q_proj has {q_rows} rows, AutoTP should leave {rows}"


@pytest.mark.launcher
def test_text_prompts_under_the_deepspeed_launcher(tmp_path, checkpoint):
    """launch/infer.py with the hf runner at cp 2: JSONL documents and questions through the chat template,
    one row cut to prompt_len, one left-padded; the result keeps the ids and adds the answers."""
    import json
    import subprocess

    from transformers import AutoTokenizer

    from megatron_ring.inference.prompts import Document, answers, text_prompts
    from tests.integration.test_inference_launcher import HAVE_DEEPSPEED, env, launch_cmd

    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed launcher not installed")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = workers.CHAT_TEMPLATE
    tokenizer.save_pretrained(checkpoint)
    (tmp_path / "long.txt").write_text("the quick brown fox jumps over the lazy dog. " * 4)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"document_file": "long.txt", "question": "Who jumps?"}) + "\n"
                                         + json.dumps({"document": "short", "question": "Why?"}) + "\n")
    work = {"batch": 2, "prompt_len": 64, "new_tokens": 5, "warmup": 0, "repeats": 1,
            "text": {"jsonl": "docs.jsonl", "chat_template": True}}
    config = tmp_path / "hf_cp2.json"
    config.write_text(json.dumps({"dtype": "fp32", "replace_with_kernel_inject": False, "megatron_ring": {
        "model": {"runner": "hf", "config": {"checkpoint": checkpoint}}, "layout": {"cp": 2},
        "workload": work, "output": str(tmp_path / "out.json")}}))
    proc = subprocess.run(launch_cmd(config, 2), env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    docs = [Document((tmp_path / "long.txt").read_text(), "Who jumps?", "docs.jsonl:1"),
            Document("short", "Why?", "docs.jsonl:2")]
    ids, mask, records = text_prompts(docs, tokenizer, prompt_len=64, chat=True)
    expected = workers.reference(checkpoint, ids, mask, 5).tolist()
    assert result["generated"] == expected
    assert result["generated_text"] == answers(tokenizer, expected)
    assert result["prompts"] == records
    assert records[0]["document_tokens_kept"] < records[0]["document_tokens"] and records[0]["padding"] == 0
    assert records[1]["padding"] > 0 and records[1]["document_tokens_kept"] == records[1]["document_tokens"]


@pytest.mark.parametrize("tp, cp", [(1, 2), (1, 4), (2, 1)], ids=["cp2", "cp4", "tp2"])
def test_perplexity_equals_the_models_loss(gloo_pool, checkpoint, tp, cp):
    """``megatron-ring perplexity``'s per-rank work (the hf runner's scores) = transformers' own loss, in total
    and by position (the loss-by-position curve)."""
    from transformers import AutoModelForCausalLM

    from megatron_ring.inference.perplexity import TOLERANCE, loss_by_position, rank_logprobs

    ids = torch.randint(0, 256, (1, 61), generator=torch.Generator().manual_seed(5))  # not a multiple of 2 cp
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    expected = -torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]  # [60] per-token loss
    per_rank = gloo_pool(tp * cp).run(rank_logprobs, {"checkpoint": checkpoint}, tp, cp, ids, timeout_s=TIMEOUT_S)
    for logprob in per_rank:
        assert logprob.shape == (60,) and torch.equal(logprob, per_rank[0])
        assert abs(-float(logprob.sum()) / 60 - float(expected.mean())) <= TOLERANCE * float(expected.mean())
        buckets = loss_by_position(logprob, 4)
        assert [(b["start"], b["end"]) for b in buckets] == [(1, 15), (16, 30), (31, 45), (46, 60)]
        for b in buckets:
            want = float(expected[b["start"] - 1:b["end"]].mean())
            assert abs(b["mean_loss"] - want) <= 1e-5 * want
