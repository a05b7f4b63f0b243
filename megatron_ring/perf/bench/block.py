"""The local block kernel on one device: exactness of each backend vs float64, and its speed.

``python -m megatron_ring.perf.bench.block --out results/bench_block.json`` on a GPU (or CPU)
checks ``block_forward``/``block_backward`` of every usable backend (``math``, ``sdpa``, and
``flash_attn`` where the flash-attn package is installed on a CUDA GPU) against a float64
reference (fp16/bf16/fp32 as the backend allows, causal and not, GQA), the single-rank
``ring_attention`` and ``decode_attention`` paths, then times forward and forward+backward of each
backend and of plain ``torch.nn.functional.scaled_dot_product_attention`` at a few lengths.

``--layouts`` instead times the ``sdpa`` block kernel on the same block with q, k, v and dout in
heads-first ``[b, h, s, d]`` storage and as views of ``[b, s, h, d]`` storage (the measurement
behind Note [Heads-first blocks] in attention/ring.py).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from megatron_ring.costs.comm_choice import BWD_COMPUTE_FACTOR, attention_flops
from megatron_ring.attention.block import block_backward, block_forward, resolve_backend
from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.api import ring_attention
from megatron_ring.attention.reference import attention_reference, rel_err
from megatron_ring.perf.bench.harness import median_time


def _qkv(b: int, s: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda h: torch.randn(b, s, h, d, generator=gen).to(device, dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), make(hq)


def _usable(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    try:
        resolve_backend(backend, device, dtype, head_dim)
    except ValueError:
        return False
    return True


def check_exactness(device: torch.device) -> list[dict]:
    """Relative errors (out, dq, dk, dv) of each usable backend vs float64, ``[b, s, h, d]`` inputs."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for causal in (False, True):
            q, k, v, do = _qkv(2, 256, 8, 2, 64, dtype, device)
            ref_in = [t.double().cpu().requires_grad_() for t in (q, k, v)]
            ref = attention_reference(*ref_in, causal=causal)
            ref.backward(do.double().cpu())
            for backend in ("math", "sdpa", "flash_attn"):
                if not _usable(backend, device, dtype, 64):
                    continue
                qh, kh, vh, doh = (t.transpose(1, 2) for t in (q, k, v, do))
                out, lse = block_forward(qh, kh, vh, causal=causal, scale=0.125, backend=backend)
                dq, dk, dv = block_backward(doh, qh, kh, vh, out, lse, causal=causal, scale=0.125, backend=backend)
                errs = {name: rel_err(x.transpose(1, 2).cpu(), r) for name, x, r in
                        (("out", out, ref), ("dq", dq, ref_in[0].grad), ("dk", dk, ref_in[1].grad),
                         ("dv", dv, ref_in[2].grad))}
                rows.append({"dtype": str(dtype).split(".")[1], "causal": causal, "backend": backend, **errs})
    return rows


def check_entry_points(device: torch.device) -> dict:
    """Single-rank ring (fwd+bwd) and decode on ``device`` vs float64."""
    q, k, v, do = _qkv(1, 512, 8, 2, 128, torch.bfloat16, device, seed=1)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, causal=True)
    out.backward(do)
    ref_in = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, causal=True)
    ref.backward(do.double().cpu())
    dec = decode_attention(q[:, -1:], k, v)
    dec_ref = attention_reference(q[:, -1:].cpu(), k.cpu(), v.cpu())
    return {"ring_out": rel_err(out.cpu(), ref), "ring_dq": rel_err(leaves[0].grad.cpu(), ref_in[0].grad),
            "ring_dk": rel_err(leaves[1].grad.cpu(), ref_in[1].grad), "decode": rel_err(dec.cpu(), dec_ref)}


def time_backends(device: torch.device, lengths: list[int], repeats: int) -> list[dict]:
    """Causal bf16 (fp32 on CPU) timings of each backend and of torch SDPA, ``[1, L, 32, 128]`` / 8 K/V heads."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    usable = [b for b in ("math", "sdpa", "flash_attn") if _usable(b, device, dtype, 128)]
    for length in lengths:
        q, k, v, do = _qkv(1, length, 32, 8, 128, dtype, device)
        qh, kh, vh, doh = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
        flops = attention_flops(batch=1, q_len=length, k_len=length, heads=32, head_dim=128, causal=True)
        for backend in (*usable, "torch_sdpa"):
            if backend == "torch_sdpa":
                def fwd():
                    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

                def fwd_bwd():
                    leaves = [t.detach().requires_grad_() for t in (qh, kh, vh)]
                    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(doh)
            else:
                def fwd(backend=backend):
                    return block_forward(qh, kh, vh, causal=True, scale=1 / math.sqrt(128), backend=backend)

                def fwd_bwd(backend=backend):
                    out, lse = block_forward(qh, kh, vh, causal=True, scale=1 / math.sqrt(128), backend=backend)
                    block_backward(doh, qh, kh, vh, out, lse, causal=True, scale=1 / math.sqrt(128), backend=backend)
            try:
                t_f, t_fb = median_time(fwd, device, repeats), median_time(fwd_bwd, device, repeats)
            except (RuntimeError, torch.OutOfMemoryError) as err:
                rows.append({"L": length, "backend": backend, "error": str(err).splitlines()[0]})
                continue
            rows.append({"L": length, "backend": backend, "fwd_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_fb,
                         "fwd_tflops": flops / t_f / 1e12,
                         "fwd_bwd_tflops": (1 + BWD_COMPUTE_FACTOR) * flops / t_fb / 1e12})
    return rows


LAYOUT_BLOCKS: tuple[tuple[int, int, int, bool], ...] = ((4096, 4096, 8, True), (4096, 2048, 8, False),
                                                        (16384, 16384, 2, True), (16384, 16384, 4, True))
"""``(q rows, k rows, heads, causal)``: a ring's diagonal and off-diagonal zigzag blocks at L = 16k,
P = 4, 8 heads, and the whole sequence on 8 / 4 and 8 / 2 heads after an all-to-all (P = 4, 2)."""


def time_layouts(device: torch.device, repeats: int,
                 blocks: tuple[tuple[int, int, int, bool], ...] = LAYOUT_BLOCKS) -> list[dict]:
    """Forward and forward+backward of the ``sdpa`` block kernel per block (default
    :data:`LAYOUT_BLOCKS`), head_dim 64, fp32 (bf16 on CUDA), in each storage; the ratio is
    heads-first / seq-first."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for q_len, k_len, heads, causal in blocks:
        times = {}
        for heads_first in (True, False):
            gen = torch.Generator(device="cpu").manual_seed(0)

            def make(n: int, heads_first: bool = heads_first) -> torch.Tensor:
                x = torch.randn(1, n, heads, 64, generator=gen).to(device, dtype)
                return x.transpose(1, 2).contiguous() if heads_first else x.transpose(1, 2)
            q, do, k, v = make(q_len), make(q_len), make(k_len), make(k_len)

            def fwd() -> tuple[torch.Tensor, torch.Tensor]:
                return block_forward(q, k, v, causal=causal, scale=0.125, backend="sdpa")

            def fwd_bwd() -> None:
                out, lse = fwd()
                block_backward(do, q, k, v, out, lse, causal=causal, scale=0.125, backend="sdpa")
            times[heads_first] = (median_time(fwd, device, repeats), median_time(fwd_bwd, device, repeats))
        rows.append({"q": q_len, "k": k_len, "heads": heads, "causal": causal,
                     "fwd_ms_heads_first": 1e3 * times[True][0], "fwd_ms_seq_first": 1e3 * times[False][0],
                     "fwd_bwd_ms_heads_first": 1e3 * times[True][1], "fwd_bwd_ms_seq_first": 1e3 * times[False][1],
                     "fwd_ratio": times[True][0] / times[False][0], "fwd_bwd_ratio": times[True][1] / times[False][1]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/bench_block.json"))
    parser.add_argument("--layouts", action="store_true", help="only time heads-first vs seq-first storage")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.layouts:
        torch.set_num_threads(1)  # as one rank of the gloo benchmarks
        rows = time_layouts(device, args.repeats)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "layouts": rows}, indent=1))
        for row in rows:
            print("layout " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        return 0
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "exactness": check_exactness(device), "entry_points": check_entry_points(device),
        "timings": time_backends(device, args.lengths, args.repeats),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"device {result['device']}, torch {result['torch']}")
    for row in result["exactness"]:
        print("exact  " + " ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print("entry  " + " ".join(f"{k}={v:.1e}" for k, v in result["entry_points"].items()))
    for row in result["timings"]:
        print("time   " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
