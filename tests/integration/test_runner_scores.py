"""``ScoringRunner.score`` (what lm-eval, loss by position and perplexity read) of both runners at cp > 1:
every row's log-probabilities and greedy flags equal the transformers model's on that row alone.

Edge rows (issue 34): a batch with rows of very different lengths, a one-token row (nothing to
predict) and a row whose share on some CP rank is all left padding. No NaN anywhere. (Unpadded rows at
cp 2, cp 4 and tp 2: the perplexity test in test_hf_runner.py; right-padded batches at cp 2: test_harness_model.py.)
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from megatron_ring.testing.tiny_hf import PAD_ID, save_tiny_model  # noqa: E402
from tests.integration import scoring_workers as workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]
TOL = 1e-5
LENGTHS = (29, 1, 4, 17)
"""Rows of the batch: long, one token, short (all padding on some CP rank at cp 3 and 4), middle."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def rows() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]


def padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows in one ``[batch, longest]`` tensor padded on ``side``, and the mask (0 on padding)."""
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows()):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, cols], mask[i, cols] = row, 1
    return ids, mask


def check(checkpoint: str, per_rank: list[tuple[torch.Tensor, torch.Tensor]], side: str) -> None:
    width = max(LENGTHS)
    for rank, (logprob, argmax) in enumerate(per_rank):
        assert logprob.shape == (len(LENGTHS), width - 1) and argmax.shape[0] == len(LENGTHS)
        assert torch.isfinite(logprob).all(), f"rank {rank}: NaN or inf in the scores"
        assert torch.equal(logprob, per_rank[0][0]) and torch.equal(argmax, per_rank[0][1]), f"rank {rank} differs"
    logprob, argmax = per_rank[0]
    for i, row in enumerate(rows()):
        start = width - len(row) if side == "left" else 0
        expected_lp, expected_argmax = workers.alone(checkpoint, row)
        assert torch.equal(argmax[i, start:start + len(row)], expected_argmax), f"row {i}: greedy tokens differ"
        if len(row) > 1:
            got = logprob[i, start:start + len(row) - 1]
            assert (got - expected_lp).abs().max() <= TOL * expected_lp.abs().max(), f"row {i} ({len(row)} tokens)"
    if side == "left":  # entries touching padding: log-probability 0, argmax -1
        _, mask = padded("left")
        assert (logprob[~(mask[:, :-1] * mask[:, 1:]).bool()] == 0).all() and (argmax[mask == 0] == -1).all()


def test_hf_runner_scores_left_padded_edge_rows(gloo_pool: Any, checkpoint: str) -> None:
    """cp 3 (an odd ring): the batch pads to 30 columns, 6 chunks of 5; the 4-token row lies in chunk 5 alone,
    so its share on CP ranks 1 and 2 is all padding."""
    sizes = {"cp": 3}
    ids, mask = padded("left")
    per_rank = gloo_pool(3).run(workers.runner_scores, "hf", {"checkpoint": checkpoint}, sizes, ids, mask,
                                    timeout_s=300)
    check(checkpoint, per_rank, "left")


@pytest.mark.parametrize("sizes", [{"pp": 2, "cp": 2}, {"tp": 2, "cp": 2, "sequence_parallel": True}],
                         ids=["pp2-cp2", "tp2-cp2-sp"])
def test_megatron_runner_scores_right_padded_rows(gloo_pool: Any, checkpoint: str, sizes: dict[str, Any]) -> None:
    """Note [Right padding for scores]: the megatron runner takes no mask; rows share a tensor padded on the right
    (pp 2 x cp 2: the last stage's scores gathered over CP, then sent along the pipeline; tp 2 x cp 2 with
    sequence parallelism: padded to a multiple of cp * tp, gathered over TP before the final norm)."""
    ids, _ = padded("right")
    model = {"checkpoint": checkpoint, "dtype": "fp32", "attention": "ring", "parallel": sizes}
    sizes = {k: v for k, v in sizes.items() if k != "sequence_parallel"}
    per_rank = gloo_pool(4).run(workers.runner_scores, "megatron", model, sizes, ids, None, timeout_s=300)
    check(checkpoint, per_rank, "right")
