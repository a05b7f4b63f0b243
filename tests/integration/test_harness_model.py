"""The lm-eval model ``megatron_ring`` (issue 34): the shipped tasks, every request type, at cp 2 give what
cp 1 gives: the same generated strings, every log-likelihood within 1e-5 relative, the same accuracy. A tiny
random Llama with a byte tokenizer; texts of short paragraphs. (SmolLM2 at 2k-8k, hf cp 1/2/4 and megatron
pp 2 x cp 2: scripts/eval_smollm2.py, docs/results/lm_eval_smollm2.)"""
from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from megatron_ring.testing.tiny_hf import save_tiny_model  # noqa: E402
from tests.integration import harness_workers as workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]
TASKS = ["ring_passkey", "ring_needle_choice", "ring_corpus_ppl"]
REL = 1e-5


def short_paragraphs(path) -> str:
    """Texts whose paragraphs fit the tiny model's 512-token window beside a needle."""
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud field light shadow quiet paper glass".split()
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(10)).capitalize() + "." for _ in range(60)))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("harness")
    checkpoint = save_tiny_model("llama", folder / "tiny")
    metadata = {"max_seq_lengths": [384, 512], "depths": [0.5], "texts": short_paragraphs(folder / "hay.txt")}
    return checkpoint, metadata


def run(pool: Any, world: int, model_args: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    per_rank = pool(world).run(workers.evaluate, model_args, TASKS, metadata, timeout_s=300)
    for rank, result in enumerate(per_rank[1:], 1):
        assert result["samples"] == per_rank[0]["samples"], f"rank {rank} answered otherwise than rank 0"
    return per_rank[0]


def same_answers(ours: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    for task in TASKS:
        for doc, (got, want) in enumerate(zip(ours["samples"][task], reference["samples"][task], strict=True)):
            for g, w in zip(got, want, strict=True):
                if isinstance(w, str):  # generate_until: the same text
                    assert g == w, f"{what} {task} doc {doc}: {g!r} != {w!r}"
                else:  # (log-likelihood, is greedy) or a rolling log-likelihood
                    g, w = (g, w) if isinstance(w, (list, tuple)) else ((g, None), (w, None))
                    assert abs(g[0] - w[0]) <= REL * abs(w[0]), f"{what} {task} doc {doc}: {g[0]} vs {w[0]}"
                    assert g[1] == w[1], f"{what} {task} doc {doc}: greedy flag differs"
    assert ours["metrics"]["ring_needle_choice"]["acc,none"] == reference["metrics"]["ring_needle_choice"]["acc,none"]
    assert ours["metrics"]["ring_passkey"]["acc,none"] == reference["metrics"]["ring_passkey"]["acc,none"]


def test_ring_cp2_answers_as_megatron_at_cp1(gloo_pool: Any, setup: tuple[str, dict[str, Any]]) -> None:
    """The hf runner's ring at cp 2 against the megatron runner at cp 1 (pp 2: the checkpoint converted into
    Megatron-core, no ring): two independent paths, one pool of 2 ranks."""
    checkpoint, metadata = setup
    base = {"checkpoint": checkpoint, "max_length": 512, "batch_size": 2}
    reference = run(gloo_pool, 2, {**base, "runner": "megatron", "pp": 2}, metadata)
    assert len(reference["samples"]["ring_passkey"]) == 2 and len(reference["samples"]["ring_corpus_ppl"]) == 2
    same_answers(run(gloo_pool, 2, {**base, "cp": 2}, metadata), reference, "hf cp 2")
