"""The all-gather's transports on gloo: the collective against the same bytes sent pairwise.

``python -m megatron_ring.perf.bench.gather --ranks 4 --mib 16 --out gather.json`` times, on gloo
ranks on this machine (one thread each), with nothing overlapping them:

* ``collective``: one ``all_gather_into_tensor`` of ``--mib`` MiB per rank (``transport.gather_stacked``);
* ``pairwise``: the same exchange as P-1 ``isend``/``irecv`` per rank (``start_gather_blocks``, the
  K/V transfer of ``comm="all_gather"`` on gloo);
* ``reduce``: P ``reduce`` calls of that size, one to each rank (the all-gather's gradient path).

Each repeat starts after a barrier; a repeat's time is its slowest rank's. This is the measurement
behind Note [Pairwise gather on gloo] in attention/gather.py.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_ring.attention.gather import start_gather_blocks
from megatron_ring.attention.transport import gather_stacked
from megatron_ring.perf.bench.harness import barrier_timed, slowest_median
from megatron_ring.runtime.args import positive_int
from megatron_ring.runtime.reporting import write_json_atomic

TRANSPORTS: tuple[str, ...] = ("collective", "pairwise", "reduce")


def gather_worker(nbytes: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    """This rank's seconds per repeat for each of :data:`TRANSPORTS`, interleaved repeat by repeat."""
    rank, size = dist.get_rank(), dist.get_world_size()
    block = torch.randn(nbytes // 4)
    grads = torch.randn(size, nbytes // 4)

    def reduce_all() -> None:
        for work in [dist.reduce(grads[owner], owner, async_op=True) for owner in range(size)]:
            work.wait()

    calls: dict[str, Callable[[], object]] = {
        "collective": lambda: gather_stacked(block, None, size),
        "pairwise": lambda: start_gather_blocks((block,), None, rank, size).wait(),
        "reduce": reduce_all,
    }
    times: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    for repeat in range(warmup + repeats):
        for name in TRANSPORTS:
            seconds = barrier_timed(calls[name])
            if repeat >= warmup:
                times[name].append(seconds)
    return times


def summarize(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """Median over repeats of the slowest rank's seconds, per transport."""
    return {name: slowest_median([r[name] for r in per_rank]) for name in TRANSPORTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=positive_int, default=4, help="gloo ranks (processes), at least 2")
    parser.add_argument("--mib", type=float, nargs="+", default=[16.0], help="MiB per rank (one point each)")
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--warmup", type=positive_int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON output")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks must be at least 2, got {args.ranks}")
    if any(m <= 0 for m in args.mib):
        parser.error(f"--mib must be positive, got {args.mib}")
    from megatron_ring.runtime.pool import GlooPool

    rows, load_before = [], os.getloadavg()
    with GlooPool(args.ranks, threads=1, timeout_s=600) as pool:
        for mib in args.mib:
            nbytes = max(4, int(mib * 2**20) // 4 * 4)
            seconds = summarize(pool.run(gather_worker, nbytes, args.repeats, args.warmup))
            rows.append({"mib": mib, "ranks": args.ranks, **{f"{k}_s": v for k, v in seconds.items()},
                         "collective_over_pairwise": seconds["collective"] / seconds["pairwise"]})
    print(f"{'MiB/rank':>9} {'ranks':>5} {'collective':>11} {'pairwise':>9} {'reduce x P':>11} {'coll/pair':>9}")
    for row in rows:
        print(f"{row['mib']:>9.3g} {row['ranks']:>5} {1e3 * row['collective_s']:>9.2f}ms {1e3 * row['pairwise_s']:>7.2f}ms "
              f"{1e3 * row['reduce_s']:>9.2f}ms {row['collective_over_pairwise']:>9.2f}")
    if args.out:
        write_json_atomic(args.out, {"rows": rows, "repeats": args.repeats, "warmup": args.warmup,
                                     "cores": os.cpu_count(), "loadavg_before": load_before,
                                     "loadavg_after": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
