"""Bad input to the attention entry points: TypeError/ValueError naming the field, value and rule."""
import pytest
import torch

from megatron_ring import decode_attention, ring_attention


def qkv(seq=4, hq=4, hkv=2, d=8, dtype=torch.float32):
    return torch.randn(1, seq, hq, d, dtype=dtype), torch.randn(1, seq, hkv, d, dtype=dtype), torch.randn(1, seq, hkv, d, dtype=dtype)


@pytest.mark.parametrize("change,exc,pattern", [
    (lambda q, k, v: (q, k[:, :, :1].expand(1, 4, 3, 8).contiguous(), v[:, :, :1].expand(1, 4, 3, 8).contiguous()),
     ValueError, r"heads_q \(4\) must be divisible by heads_kv \(3\)"),
    (lambda q, k, v: (q[..., :6], k, v), ValueError, r"head_dim mismatch: q has 6, k/v have 8"),
    (lambda q, k, v: (q[:, :2], k, v), ValueError, r"seq_local mismatch: q has 2, k/v have 4"),
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D \[batch, seq, heads, head_dim\], got shape \(4, 4, 8\)"),
    (lambda q, k, v: (q, k.half(), v), TypeError, r"q, k, v must share a dtype"),
    (lambda q, k, v: (q.int(), k, v), TypeError, r"q.dtype is torch.int32; allowed"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, r"q must be a torch.Tensor, got list"),
    (lambda q, k, v: (q, k, v[..., :4]), ValueError, r"k and v must have the same shape"),
])
def test_shape_and_dtype_errors(change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ring_attention(*change(*qkv()))


def test_unknown_choices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"sharding must be one of \['zigzag', 'contiguous'\], got 'zig'"):
        ring_attention(q, k, v, sharding="zig")
    with pytest.raises(ValueError, match=r"comm must be one of \['p2p', 'all_gather', 'a2a', 'a2a\+p2p', 'auto'\], "
                                         r"got 'ulysses'"):
        ring_attention(q, k, v, comm="ulysses")
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'cudnn'"):
        ring_attention(q, k, v, backend="cudnn")
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive number or None, got -1"):
        ring_attention(q, k, v, softmax_scale=-1)
    with pytest.raises(TypeError, match=r"causal must be a bool, got 'yes'"):
        ring_attention(q, k, v, causal="yes")


def test_decode_checks_inputs():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="head_dim mismatch"):
        decode_attention(q[:, :1], k[..., :4], v[..., :4])


def test_single_process_ring_is_plain_attention():
    from megatron_ring.attention.reference import attention_reference, rel_err

    q, k, v = qkv(seq=7)
    for causal in (True, False):
        assert rel_err(ring_attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal)) < 1e-6


def test_backend_choice():
    from megatron_ring.attention.block import resolve_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, torch.float32, 5) == "sdpa"
    assert resolve_backend("auto", cuda, torch.bfloat16, 128) == "sdpa"
    assert resolve_backend("auto", cuda, torch.float32, 128) == "math"
    assert resolve_backend("auto", cuda, torch.bfloat16, 100) == "math"
    assert resolve_backend("math", cuda, torch.bfloat16, 128) == "math"
    with pytest.raises(ValueError, match="backend 'sdpa' cannot take device=cuda, dtype=torch.float32"):
        resolve_backend("sdpa", cuda, torch.float32, 128)


def test_key_padding_mask_checks():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"key_padding_mask.dtype is torch.int64; allowed: torch.bool"):
        ring_attention(q, k, v, key_padding_mask=torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, seq\] = \(1, 4\) like k, got shape \(4,\)"):
        ring_attention(q, k, v, key_padding_mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"key_padding_mask must be a torch.Tensor or None, got list"):
        decode_attention(q[:, :1], k, v, key_padding_mask=[[True] * 4])
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, seq\] = \(1, 4\)"):
        decode_attention(q[:, :1], k, v, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))


def test_backend_choice_with_a_key_padding_mask():
    from megatron_ring.attention.block import resolve_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, torch.bfloat16, 64, masked=True) == "sdpa"
    assert resolve_backend("auto", cuda, torch.bfloat16, 64, masked=True) == "sdpa"
    assert resolve_backend("auto", cuda, torch.float32, 64, masked=True) == "math"
    assert resolve_backend("math", cuda, torch.bfloat16, 64, masked=True) == "math"
    with pytest.raises(ValueError, match=r"backend 'flash_attn' cannot take a key_padding_mask on device=cuda"):
        resolve_backend("flash_attn", cuda, torch.bfloat16, 64, masked=True)


def test_single_process_padding_matches_reference():
    from megatron_ring.attention.reference import attention_reference, rel_err

    q, k, v = qkv(seq=6)
    mask = torch.tensor([[False, False, True, True, False, True]])
    for causal in (True, False):
        out = ring_attention(q, k, v, causal=causal, key_padding_mask=mask)
        assert rel_err(out, attention_reference(q, k, v, causal=causal, key_padding_mask=mask)) < 1e-6
        if causal:
            assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))  # nothing real to see yet


def test_block_kernels_refuse_a_mask_they_cannot_apply():
    from megatron_ring.attention.block import block_backward, block_forward

    q, k, v = (t.transpose(1, 2) for t in qkv())
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"backend 'flash_attn' on cpu cannot apply a key mask"):
        block_forward(q, k, v, causal=False, scale=0.3, backend="flash_attn", key_mask=mask)
    with pytest.raises(ValueError, match=r"backend 'flash_attn' on cpu cannot apply a key mask"):
        block_backward(q, q, k, v, q, q[..., 0], causal=False, scale=0.3, backend="flash_attn", key_mask=mask)


@pytest.mark.parametrize("causal", [True, False])
def test_long_left_padding_over_kernel_blocks(causal):
    """700 padded keys span the CPU kernel's first 512-key block: no NaN, same as float64."""
    from megatron_ring.attention.reference import attention_reference, rel_err

    q, k, v = qkv(seq=1200, hq=2, hkv=1, d=8)
    mask = torch.ones(1, 1200, dtype=torch.bool)
    mask[:, :700] = False
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, causal=causal, key_padding_mask=mask, backend="auto")
    out.sum().backward()
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*refs, causal=causal, key_padding_mask=mask)
    ref.sum().backward()
    assert rel_err(out, ref) < 1e-5
    for leaf, ref_leaf in zip(leaves, refs):
        assert rel_err(leaf.grad, ref_leaf.grad) < 1e-5


ZERO_SIZES = {  # field -> (q shape, k/v shape, the ValueError or None for an empty result); single process
    "batch": ((0, 4, 4, 8), (0, 4, 2, 8), None),
    "seq": ((1, 0, 4, 8), (1, 0, 2, 8), r"q has seq_local = 0; ring_attention needs at least one token per rank"),
    "heads": ((1, 4, 0, 8), (1, 4, 2, 8), r"q has heads_q = 0; heads_q must be >= 1"),
    "heads_kv": ((1, 4, 4, 8), (1, 4, 0, 8), r"k has heads_kv = 0; heads_kv must be >= 1"),
    "head_dim": ((1, 4, 4, 0), (1, 4, 2, 0), r"q has head_dim = 0; head_dim must be >= 1"),
}


@pytest.fixture(params=["math", "sdpa", "auto", "flash_attn"])
def any_backend(request, monkeypatch):
    """Each block backend; "flash_attn" served on CPU by the stand-in of the package
    (tests/unit/flash_attn_standin.py)."""
    if request.param != "flash_attn":
        yield request.param
        return
    import sys

    from megatron_ring.attention import block, flash_attn_backend
    from tests.unit import flash_attn_standin as standin

    for name, module in standin.modules("2.7.4.post1").items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(block, "flash_attn_problem", lambda device, dtype, head_dim: None)
    flash_attn_backend._load.cache_clear()
    yield request.param
    flash_attn_backend._load.cache_clear()


@pytest.mark.parametrize("field", list(ZERO_SIZES))
def test_ring_zero_sizes_single_process(any_backend, field):
    """No SIGFPE in the CPU kernel: a ValueError naming the field, or (batch 0) an empty result."""
    q_shape, kv_shape, error = ZERO_SIZES[field]
    backend = any_backend
    dtype = torch.bfloat16 if backend == "flash_attn" else torch.float32
    q = torch.randn(q_shape, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(kv_shape, dtype=dtype, requires_grad=True) for _ in range(2))
    if error is not None:
        with pytest.raises(ValueError, match=error):
            ring_attention(q, k, v, causal=True, backend=backend)
        return
    out = ring_attention(q, k, v, causal=True, backend=backend)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == v.grad.shape == k.shape


@pytest.mark.parametrize("field", [*ZERO_SIZES, "cache"])
def test_decode_zero_sizes_single_process(any_backend, field):
    """batch 0: empty; q_len 0, heads 0, head_dim 0: ValueError; an empty cache: the zero output."""
    q_shape, kv_shape, error = ZERO_SIZES.get(field, ((2, 1, 4, 8), (2, 0, 2, 8), None))
    if field == "seq":
        kv_shape, error = (1, 3, 2, 8), r"q has q_len = 0; decode_attention needs at least one query token"
    backend = any_backend
    dtype = torch.bfloat16 if backend == "flash_attn" else torch.float32
    q, k = torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)
    if error is not None:
        with pytest.raises(ValueError, match=error):
            decode_attention(q, k, k, backend=backend)
        return
    out = decode_attention(q, k, k, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype and not out.abs().sum()


def test_check_consistency_is_a_no_op_in_one_process():
    q, k, v = qkv()
    assert torch.equal(ring_attention(q, k, v, check_consistency=False), ring_attention(q, k, v))
    assert torch.equal(decode_attention(q[:, :1], k, v, check_consistency=False), decode_attention(q[:, :1], k, v))


@pytest.mark.parametrize("packed", [False, True], ids=["window", "cu_seqlens"])
def test_all_to_all_refuses_windows_and_packed_documents(packed):
    """(``a2a+p2p`` takes the same check, once given its two groups.)"""
    q, k, v = qkv(seq=8)
    kwargs = dict(cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32)) if packed else dict(window_size=(2, 0))
    if packed:
        q, k, v = q[0], k[0], v[0]
    with pytest.raises(ValueError, match=r"comm='a2a' does not support window_size or cu_seqlens; allowed"):
        ring_attention(q, k, v, causal=True, comm="a2a", **kwargs)
