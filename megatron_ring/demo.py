"""A small ring-attention check over the world group: shard, run the ring, compare with float64.

``torchrun --nproc_per_node 4 -m megatron_ring.demo`` (gloo on CPU, nccl on GPUs); ``megatron-ring demo``
and ``launch/ring_demo.py`` start it. ``--comm a2a+p2p`` runs hierarchical CP with the all-to-all
inside each node (``--cp-a2a``, default the ranks per node the launcher reports) and the ring across
nodes, and reports whether every a2a group stayed within one node (docs/multinode.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.comms import COMMS
from megatron_ring.attention.transport import ring_stats
from megatron_ring.attention.api import ring_attention
from megatron_ring.attention.sharding import shard_sequence
from megatron_ring.attention.reference import attention_reference, rel_err
from megatron_ring.parallel.groups import leave_distributed
from megatron_ring.runtime.args import positive_int, usage_error




def _node() -> str:
    """This process's node rank as the launcher gives it: torchrun's ``GROUP_RANK``, DeepSpeed's ``CROSS_RANK``."""
    return os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", "0"))


def _cp_group(comm: str, cp_a2a: int) -> tuple[object, bool]:
    """The ``group`` for ``comm`` over the world and whether its a2a groups each sit on one node
    (:func:`_node`; True when there are none)."""
    if comm != "a2a+p2p":
        return None, True
    from megatron_ring.parallel import ParallelLayout, init_parallel

    groups = init_parallel(ParallelLayout(cp=dist.get_world_size(), cp_a2a=cp_a2a))
    nodes: list[object] = [None] * cp_a2a
    dist.all_gather_object(nodes, _node(), group=groups.cp_groups.a2a)
    return groups.cp_groups, len(set(nodes)) == 1


def ring_demo(seq_len: int, heads: int, heads_kv: int, head_dim: int, dtype: torch.dtype,
              device: torch.device, comm: str = "p2p", cp_a2a: int = 1) -> dict[str, float]:
    """Causal zigzag attention with ``comm`` over the world group vs a float64 reference; this rank's numbers."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group, one_node = _cp_group(comm, cp_a2a)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_len, heads, head_dim, generator=gen)
    k = torch.randn(1, seq_len, heads_kv, head_dim, generator=gen)
    v = torch.randn(1, seq_len, heads_kv, head_dim, generator=gen)
    ql, kl, vl = (shard_sequence(t, rank, size).to(device, dtype).requires_grad_() for t in (q, k, v))
    with ring_stats() as stats:
        start = time.perf_counter()
        out = ring_attention(ql, kl, vl, group, causal=True, comm=comm)
        out.sum().backward()
        elapsed = time.perf_counter() - start
    reference = shard_sequence(attention_reference(q, k, v, causal=True), rank, size)
    return {
        "rank": rank, "tokens": ql.shape[1], "rel_err": rel_err(out.cpu(), reference),
        "fwd_bwd_ms": 1e3 * elapsed, "sent_MiB": stats.bytes_sent / 2**20, "ring_steps": stats.steps,
        "node": _node(), "a2a_in_one_node": one_node,
    }


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags (``megatron-ring demo`` adds ``--nproc`` to them)."""
    parser.add_argument("--seq-len", type=positive_int, default=4096,
                        help="global sequence length, divisible by 2 x ranks (zigzag sharding)")
    parser.add_argument("--heads", type=positive_int, default=8, help="query heads")
    parser.add_argument("--heads-kv", type=positive_int, default=2, help="K/V heads (GQA), dividing --heads")
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--comm", choices=COMMS, default="p2p", help="ring_attention's comm")
    parser.add_argument("--cp-a2a", type=positive_int, default=None,
                        help="a2a group size of --comm a2a+p2p (default: LOCAL_WORLD_SIZE, the ranks of one node)")


def check_demo_args(args: argparse.Namespace, ranks: int) -> None:
    """ValueError naming the flags when ``args`` cannot run on ``ranks`` processes."""
    if args.heads % args.heads_kv:
        raise ValueError(f"--heads {args.heads} is not a multiple of --heads-kv {args.heads_kv}")
    if args.comm == "a2a+p2p" and (ranks % _a2a_size(args) or args.heads % _a2a_size(args)):
        raise ValueError(f"--cp-a2a {_a2a_size(args)} must divide the {ranks} ranks and --heads {args.heads}")
    if args.comm == "a2a" and args.heads % ranks:
        raise ValueError(f"--comm a2a needs --heads {args.heads} divisible by the {ranks} ranks")
    if args.seq_len % (2 * ranks):
        raise ValueError(f"--seq-len {args.seq_len} is not divisible by 2 x {ranks} ranks = {2 * ranks}: zigzag "
                          "sharding gives every rank two equal chunks")


def _a2a_size(args: argparse.Namespace) -> int:
    """``--cp-a2a``, else the ranks of one node (torchrun's ``LOCAL_WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE``)."""
    return args.cp_a2a or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))


def demo_argv(args: argparse.Namespace) -> list[str]:
    """The flags of :func:`add_demo_arguments` with their values in ``args``, as argv for :func:`demo_main`."""
    return [f"--seq-len={args.seq_len}", f"--heads={args.heads}", f"--heads-kv={args.heads_kv}",
            f"--head-dim={args.head_dim}", f"--dtype={args.dtype}", f"--comm={args.comm}"] + \
        ([f"--cp-a2a={args.cp_a2a}"] if args.cp_a2a else [])


def demo_main(argv: Optional[Sequence[str]] = None) -> int:
    """One rank of the demo: run it under a launcher (``torchrun -m megatron_ring.demo``); returns the exit status.

    The flags are checked against the launched world size before any process group exists.
    """
    parser = argparse.ArgumentParser(prog="python -m megatron_ring.demo", description=__doc__.split("\n")[0])
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_demo_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as err:
        return usage_error(parser.prog, err)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    row = ring_demo(args.seq_len, args.heads, args.heads_kv, args.head_dim, getattr(torch, args.dtype), device,
                    args.comm, _a2a_size(args))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        hier = f" (a2a {_a2a_size(args)} x ring {len(rows) // _a2a_size(args)})" if args.comm == "a2a+p2p" else ""
        print(f"ring attention, causal zigzag, comm={args.comm}{hier}, L={args.seq_len}, heads "
              f"{args.heads}/{args.heads_kv}, head_dim {args.head_dim}, {args.dtype}, cp={len(rows)}")
        print(f"{'rank':>4} {'node':>4} {'tokens':>7} {'rel err vs fp64':>16} {'fwd+bwd ms':>11} {'sent MiB':>9}")
        for r in rows:
            print(f"{r['rank']:>4} {r['node']:>4} {r['tokens']:>7} {r['rel_err']:>16.2e} {r['fwd_bwd_ms']:>11.1f} "
                  f"{r['sent_MiB']:>9.2f}")
        if args.comm == "a2a+p2p":
            inside = all(r["a2a_in_one_node"] for r in rows)
            print(f"a2a groups within one node: {'yes' if inside else 'NO'}")
    leave_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(demo_main())
