"""The custom ops behind torch.compile (Note [torch.compile] in attention/ops.py), on one process."""
import pytest
import torch

from megatron_ring import decode_attention, ring_attention
from megatron_ring.attention.opaque import read_call

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
    """A float whose ``repr`` is not the float's literal."""


def test_an_option_that_is_no_literal_runs_the_eager_code():
    """A float subclass cannot cross as a literal: dynamo breaks the graph and runs the eager path."""
    q, k, v = _qkv()
    scale = Scale(1 / 3)

    def attend(q, k, v):
        return ring_attention(q, k, v, softmax_scale=scale)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(attend, backend="eager")(q, k, v), attend(q, k, v), rtol=0, atol=0)
