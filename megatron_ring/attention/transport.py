"""How K/V blocks travel between the ranks of a CP group, and what that costs.

A transport serves the ring loops of ring.py (:class:`KVTransport`): it yields the K/V of a piece of work (schedule.py's
``Piece``, Note [Pieces] in ring.py) block by block: relay.py's ``RelayRing`` (``comm="p2p"``), direct.py's
``DirectTransfers`` (``p2p`` under a window or packed documents), gather.py's ``GatheredBlocks`` (``all_gather``);
dilated_transport.py moves a dilated call's pieces through the last two. What they share lives here: :func:`post`
(point-to-point transfers addressed by group rank, their bytes counted), :func:`wait_all` (timed waits),
:func:`gather_stacked` (one small all-gather) and the counters of :func:`ring_stats`.

``RingStats.wait_s`` is the time the ring spends blocked on communication after its compute for a step is done: the
*exposed* communication. On CUDA the ring synchronises the device while stats are active (to time kernels from the
host), which removes some overlap; use it to measure, not to run. The statistics wrap a transport's iteration
(:func:`timed`), so the loops hold no timing code.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_ring.attention.schedule import Piece

T = TypeVar("T")

Block = tuple[int, "Piece", torch.Tensor, torch.Tensor]
"""``(src, piece, k_src, v_src)``: the K/V of ``piece`` (schedule.py's unit of work) in the block of CP rank ``src``,
each ``[batch, piece's K/V heads, rows, head_dim]``: the heads and rows the piece's plans index (Note [Pieces])."""
GradPieces = list[tuple[slice, slice, torch.Tensor, torch.Tensor]]
"""``(heads, rows, dk, dv)`` pieces of one block's gradient: ``dk``/``dv`` ``[batch, heads, rows, head_dim]`` belong to
K/V heads ``heads`` (relative to the piece's) and key rows ``rows``."""
BlockAndGrads = tuple[int, "Piece", torch.Tensor, torch.Tensor, GradPieces]
"""``(src, piece, k_src, v_src, outbox)``: a block and the list the caller appends its gradient pieces to."""


class KVTransport(Protocol):
    """The K/V blocks of one ring call, forward or backward; built per pass, never reused. ``k``/``v`` are this rank's
    block ``[batch, heads_kv, seq_local, head_dim]`` (heads-first)."""

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        """Forward: every block this rank's plans read, once per piece, piece after piece (the relay: every block's
        first head group, then every block's next; the all-gather of a dilated call: every piece of a block, block after
        block); the next transfer is in flight while the caller computes on the one yielded. ``k``/``v`` may be views of
        any strides (the transport copies them heads-first)."""
        ...

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """Backward: the same blocks, each with an empty outbox for its gradient pieces. When the caller moves on, the
        transport adds the pieces up and carries them toward the block's owner, behind the next block's compute; when
        the iteration ends, ``dkv`` (zeros on entry, ``[2, batch, heads_kv, seq_local, head_dim]`` fp32) holds this
        rank's own dK/dV summed over every rank."""
        ...


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (None: the world)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def add_pieces(acc: torch.Tensor, pieces: GradPieces, first_row: int = 0) -> None:
    """Add gradient pieces into ``acc`` ``[2, batch, heads_kv, rows, head_dim]``, whose row 0 is key row
    ``first_row``."""
    for heads, rows, dk, dv in pieces:
        at = slice(rows.start - first_row, rows.stop - first_row)
        acc[0][:, heads, at] += dk
        acc[1][:, heads, at] += dv


def post(group: dist.ProcessGroup | None, sends: Sequence[tuple[int, torch.Tensor]],
         recvs: Sequence[tuple[int, torch.Tensor]], tag: int) -> list[dist.Work]:
    """Start the sends ``(peer, tensor)`` and receives ``(peer, buffer)`` as one batch (peers are
    ranks of ``group``); the bytes sent count as one step of the active :class:`RingStats`."""
    ops = [dist.P2POp(dist.isend, t, global_rank(group, p), group, tag) for p, t in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank(group, p), group, tag) for p, t in recvs]
    if sends:
        count_sent(1, sum(t.numel() * t.element_size() for _, t in sends))
    return dist.batch_isend_irecv(ops) if ops else []


def gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: ``[size, *x.shape]`` (one all-gather, waited for)."""
    if size == 1:
        return x.unsqueeze(0)
    stacked, work = start_all_gather(x, group, size)
    work.wait()
    return stacked


def start_all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> tuple[torch.Tensor, dist.Work]:
    """Start one all-gather of ``x`` into ``[size, *x.shape]``, in rank order."""
    flat = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    return flat.view(size, *x.shape), gather(flat, x.contiguous(), group=group, async_op=True)


@dataclass
class RingStats:
    """Totals over every ring call (forward and backward) made inside one :func:`ring_stats` block, on this rank.
    ``steps`` counts communication rounds: P-1 per forward and head group (the relay runs one ring per head group,
    ``RingCall.relay_pieces`` of them, Note [Forward memory]), 2P-1 per backward (P-1 K/V rotations and P gradient transfers).
    ``bytes_sent`` counts what this rank sends; for ``comm="all_gather"`` the equivalent ring volume. Direct transfers
    (direct.py) count only the steps in which this rank sends, and what it sends."""

    calls: int = 0
    steps: int = 0
    bytes_sent: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    total_s: float = 0.0

    @property
    def exposed_fraction(self) -> float:
        """Share of the ring's time spent waiting on communication (0 when nothing was timed)."""
        return self.wait_s / self.total_s if self.total_s else 0.0


_ACTIVE: list[RingStats] = []


@contextmanager
def ring_stats() -> Iterator[RingStats]:
    """Collect :class:`RingStats` for the ring calls made inside the block."""
    stats = RingStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def active_stats() -> RingStats | None:
    return _ACTIVE[-1] if _ACTIVE else None


def timed(blocks: Iterator[T], device: torch.device, *, forward: bool = False) -> Iterator[T]:
    """``blocks`` (a transport's iteration), timed into the active :class:`RingStats` when there is
    one: the time the caller spends on each yielded block is ``compute_s``, the whole iteration
    ``total_s``, a forward one more ``calls``. Without stats, ``blocks`` itself: nothing is added."""
    stats = active_stats()
    return blocks if stats is None else _timed(blocks, device, stats, forward)


def _timed(blocks: Iterator[T], device: torch.device, stats: RingStats, forward: bool) -> Iterator[T]:
    start = now(device)
    for block in blocks:
        computing = now(device)
        yield block
        stats.compute_s += now(device) - computing
    stats.calls += forward
    stats.total_s += now(device) - start


def count_sent(steps: int, nbytes: int) -> None:
    """Add ``steps`` communication rounds sending ``nbytes`` to the active :class:`RingStats`."""
    stats = active_stats()
    if stats:
        stats.steps += steps
        stats.bytes_sent += nbytes


def now(device: torch.device) -> float:
    """Host clock, after draining the device queue when it is a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def wait_all(works: Sequence[dist.Work], device: torch.device) -> None:
    """Wait for ``works``, adding the time to the active :class:`RingStats` ``wait_s``."""
    if not works:
        return
    stats = active_stats()
    start = now(device) if stats else 0.0
    for work in works:
        work.wait()
    if stats:
        stats.wait_s += now(device) - start
