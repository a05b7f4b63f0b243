"""torch.compile workers for tests/gloo/test_compile.py (run on every rank of a gloo pool)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from megatron_ring import decode_attention, ring_attention
from tests.gloo.workers import _inputs, padding_mask


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def ring_compiled_vs_eager(backend: str, padded: bool, seq: int = 8) -> dict[str, float]:
    """Max |compiled - eager| of this rank's output and q/k/v gradients (causal, GQA, ``padded``: a key
    padding mask), compiled with ``fullgraph=True``, and the graph breaks ``torch._dynamo.explain`` counts."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (t[:, rank * seq:(rank + 1) * seq] for t in _inputs(3, seq * size, 4, 2, 8, torch.float32))
    mask = padding_mask(3, seq * size)[:, rank * seq:(rank + 1) * seq] if padded else None

    def attend(q, k, v, mask):
        return ring_attention(q, k, v, causal=True, sharding="contiguous", key_padding_mask=mask) * 2

    torch._dynamo.reset()
    breaks = torch._dynamo.explain(attend)(q, k, v, mask).graph_break_count
    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    results = {}
    for name, fn in (("eager", attend), ("compiled", compiled)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, mask)
        out.backward(dout)
        results[name] = [out, *(t.grad for t in leaves)]
    diffs = {name: (a - b).abs().max().item()
             for name, a, b in zip(("out", "dq", "dk", "dv"), results["eager"], results["compiled"])}
    return {**diffs, "graph_breaks": breaks}


def decode_steps_compiled(steps: int = 5) -> dict[str, object]:
    """A compiled decode step (append this step's K/V to a growing cache shard, then attend over a
    new process group) over ``steps`` steps: max |compiled - eager|, graphs compiled, graph breaks."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1 + rank)  # each rank's own shard
    k_cache, v_cache = torch.randn(2, 3 + rank, 2, 8, generator=gen), torch.randn(2, 3 + rank, 2, 8, generator=gen)
    torch.manual_seed(7)  # the new tokens' q (identical on every rank) and K/V
    news = [(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)) for _ in range(steps)]

    group = dist.new_group(list(range(dist.get_world_size())))  # a group of its own: crosses into the op by name

    def step(q, k_cache, v_cache, k_new, v_new):
        k_cache, v_cache = torch.cat([k_cache, k_new], 1), torch.cat([v_cache, v_new], 1)
        return decode_attention(q, k_cache, v_cache, group), k_cache, v_cache

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    diffs = []
    kc, vc, ke, ve = k_cache, v_cache, k_cache, v_cache
    for q, k_new, v_new in news:
        torch._dynamo.maybe_mark_dynamic(kc, 1)
        torch._dynamo.maybe_mark_dynamic(vc, 1)
        out_c, kc, vc = compiled(q, kc, vc, k_new, v_new)
        out_e, ke, ve = step(q, ke, ve, k_new, v_new)
        diffs.append((out_c - out_e).abs().max().item())
    return {"diff": max(diffs), "graphs": _graphs(), "graph_breaks": _breaks()}


def mismatched_call_under_compile() -> str:
    """Rank 1 passes ``causal=False``: the handshake inside the op raises on every rank."""
    q, k, v, _ = _inputs(1, 4, 2, 2, 8, torch.float32)
    causal = dist.get_rank() == 0
    try:
        torch.compile(lambda q, k, v: ring_attention(q, k, v, causal=causal), backend="eager", fullgraph=True)(q, k, v)
    except ValueError as err:
        return str(err)
    return "no error"


def hf_compiled_logits(backend: str) -> dict[str, object]:
    """A tiny Llama, ``model.forward`` compiled, through ``ring_forward`` (a padded batch): max |compiled -
    eager ring| and |compiled - one process|, graph breaks."""
    from megatron_ring.hf import enable_ring_attention, ring_forward
    from megatron_ring.testing.tiny_hf import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    single = model(input_ids=ids, attention_mask=mask).logits
    enable_ring_attention(model)
    eager = ring_forward(model, ids, mask)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    compiled = ring_forward(model, ids, mask)
    real = mask.bool()
    return {"vs_eager": (compiled - eager).abs().max().item(),
            "vs_single": (compiled - single)[real].abs().max().item(), "graph_breaks": _breaks()}


def hf_compiled_generate(new_tokens: int = 6) -> dict[str, object]:
    """``ring_generate`` with a compiled ``model.forward`` (aot_eager), twice (the second longer):
    whether the tokens equal eager, and the graph count after each decode step of each call."""
    from transformers import LogitsProcessor

    from megatron_ring.hf import enable_ring_attention, ring_generate
    from megatron_ring.testing.tiny_hf import tiny_model

    class GraphCount(LogitsProcessor):
        def __init__(self) -> None:
            self.graphs: list[int] = []

        def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.graphs.append(_graphs())
            return scores

    model = enable_ring_attention(tiny_model("llama"))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eager = ring_generate(model, ids, mask, max_new_tokens=2 * new_tokens)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend="aot_eager")
    same, graphs = [], []
    for n in (new_tokens, 2 * new_tokens):
        count = GraphCount()
        out = ring_generate(model, ids, mask, max_new_tokens=n, logits_processor=[count])
        same.append(bool((out == eager[:, :out.shape[1]]).all()))
        graphs.append(count.graphs)
    return {"same": same, "graphs": graphs, "graph_breaks": _breaks()}
