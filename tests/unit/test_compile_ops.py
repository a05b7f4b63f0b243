"""The custom ops behind torch.compile (Note [torch.compile] in attention/ops.py), on one process."""
import pytest
import torch

from megatron_ring import decode_attention, ring_attention
from megatron_ring.attention.opaque import call_op, read_call

OPTIONS = repr({"causal": True, "softmax_scale": None, "sharding": "zigzag", "comm": "p2p", "backend": "auto",
                "check_consistency": True, "tensors": ("key_padding_mask",)})


def _qkv(seq=6, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, seq, h, 8, generator=gen) for h in (4, 2, 2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def test_ops_pass_torch_library_opcheck():
    """Schema, fake implementations (shapes, dtypes, strides) and the autograd registration."""
    q, k, v = _qkv(requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    for extras in ([None], [mask]):
        torch.library.opcheck(torch.ops.megatron_ring.ring_attention.default, (q, k, v, extras, "", OPTIONS))
    decode_options = repr({"softmax_scale": 0.5, "backend": "auto", "check_consistency": True,
                           "tensors": ("key_padding_mask",)})
    torch.library.opcheck(torch.ops.megatron_ring.decode_attention.default,
                          (q[:, :1].detach(), k.detach(), v.detach(), [None], "", decode_options))


def test_read_call_gives_back_group_and_keyword_arguments():
    mask = torch.ones(2, 6, dtype=torch.bool)
    group, kwargs = read_call("", OPTIONS, [mask])
    assert group is None
    assert kwargs.pop("key_padding_mask") is mask
    assert kwargs == {"causal": True, "softmax_scale": None, "sharding": "zigzag", "comm": "p2p", "backend": "auto",
                      "check_consistency": True}


def test_the_op_raises_the_eager_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"sharding must be one of \['zigzag', 'contiguous'\], got 'bogus'"):
        torch.ops.megatron_ring.ring_attention(q, k, v, [None], "", OPTIONS.replace("'zigzag'", "'bogus'"))


def test_compiled_single_process_equals_eager_without_graph_breaks():
    q, k, v = _qkv()

    def attend(q, k, v):
        return ring_attention(q, k, v, causal=True), decode_attention(q[:, -1:], k, v)

    torch._dynamo.reset()
    assert torch._dynamo.explain(attend)(q, k, v).graph_break_count == 0
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
    for got, want in zip(compiled, attend(q, k, v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class Scale(float):
    """A float whose ``repr`` is not its value: the value is 1/3, the ``repr`` says 1.0.

    Through the op (``repr`` + ``ast.literal_eval``, attention/opaque.py) the scale would arrive as
    1.0; only the eager code sees 1/3."""

    def __repr__(self) -> str:
        return "1.0"


def _ops_in(explained) -> list[str]:
    """The megatron_ring custom ops in the graphs dynamo captured."""
    return [str(node.target) for graph in explained.graphs for node in graph.graph.nodes
            if "megatron_ring" in str(node.target)]


def test_an_option_that_is_no_literal_reaches_the_eager_code_not_the_op():
    """``call_op`` refuses an option that is not a literal (here a float subclass whose ``repr``
    lies), so the compiled call runs the eager code with the option itself (dynamo traces it where
    it can: on one process there is no collective to break on): the result is that of scale 1/3,
    not of the 1.0 the op would read back, and no captured graph holds the op (while the same call
    with a plain float does)."""
    q, k, v = _qkv()
    scale = Scale(1 / 3)
    want = ring_attention(q, k, v, softmax_scale=1 / 3)
    through_repr = ring_attention(q, k, v, softmax_scale=1.0)
    assert (want - through_repr).abs().max() > 1e-3  # the two scales give different results

    options = dict(causal=False, softmax_scale=scale, sharding="zigzag", comm="p2p", backend="auto",
                   window_size=(-1, -1), check_consistency=True)  # ring_attention's, as it calls call_op
    assert call_op("ring_attention", (q, k, v), None, {"key_padding_mask": None}, options) is None

    def attend(q, k, v):
        return ring_attention(q, k, v, softmax_scale=scale)

    def attend_literal(q, k, v):
        return ring_attention(q, k, v, softmax_scale=1 / 3)

    torch._dynamo.reset()
    assert _ops_in(torch._dynamo.explain(attend_literal)(q, k, v)) == ["megatron_ring.ring_attention"]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(attend)(q, k, v)
    assert _ops_in(explained) == []
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(attend, backend="eager")(q, k, v), want, rtol=0, atol=0)
