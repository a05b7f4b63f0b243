"""One loop, one autograd Function, one transport protocol for every ring variant (Note [Pieces] in
attention/ring.py); statistics wrap the transport instead of branching in the loop. One process."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from megatron_ring.attention import ring
from megatron_ring.attention.api import ring_attention
from megatron_ring.attention.transport import ring_stats

ATTENTION = Path(ring.__file__).parent


def _autograd_functions() -> dict[str, str]:
    """``{class name: file}`` of every torch.autograd.Function subclass in attention/."""
    found = {}
    for path in ATTENTION.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("autograd.Function") for b in node.bases):
                found[node.name] = path.name
    return found


def test_one_autograd_function_for_every_ring_variant() -> None:
    """The ring's Function, and the all-to-all's exchange (no attention in it)."""
    assert _autograd_functions() == {"_RingFunction": "ring.py", "_AllToAll": "alltoall.py"}


def test_plain_windowed_and_dilated_calls_run_the_ring_function() -> None:
    q = torch.randn(1, 16, 4, 8, requires_grad=True)
    for options in ({}, {"window_size": (3, 0)}, {"dilation": ((8, 2),)}, {"dilation": ((8, 2),), "comm": "all_gather"}):
        out = ring_attention(q, q, q, causal=True, **options)
        node = out.grad_fn.next_functions[0][0]  # under the transpose back to [b, s, h, d]
        assert type(node).__name__.startswith("_RingFunction"), (options, node)


def test_the_loops_hold_no_timing_code_and_stats_still_count() -> None:
    for loop in (ring.ring_forward, ring.ring_backward):
        assert "stats" not in inspect.getsource(loop) and "now(" not in inspect.getsource(loop)
    q = torch.randn(1, 16, 4, 8, requires_grad=True)
    with ring_stats() as stats:
        ring_attention(q, q, q, causal=True).sum().backward()
    assert stats.calls == 1 and stats.compute_s > 0 and stats.total_s >= stats.compute_s
