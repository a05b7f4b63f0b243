"""K/V transfers for sparse schedules (sliding windows, packed documents): each block goes straight
from its owner to the ranks that use it, and only the rows they use.

Note [Direct transfers]
~~~~~~~~~~~~~~~~~~~~~~~
The plain ring relays every block through every rank: P-1 hops, whatever the work. With a window
(or documents) a rank needs few blocks, and often only some of their rows: under causal zigzag
with a window of one chunk, rank r needs one chunk from its left and one from its right
neighbour, which a relay would only deliver at the *last* step, after every transfer. So here,
at step t (t = 1..P-1), rank r

* receives block ``src = (r - t) mod P`` straight from ``src``, only the rows its plans read
  (``RankSchedule.recv_rows[t]``), and only when its plan for ``src`` is not empty;
* sends the rows of its own K/V that rank ``(r + t) mod P`` reads (``send_rows[t]``), if any.

A step where a rank neither sends nor receives is skipped (no kernel call, no transfer): the rule
is "transfer exactly the rows some plan reads", so once no remaining block can fall in the window
nothing more moves; with contiguous sharding and a causal window of w chunks this is the ring
stopping after ``ceil(w)`` steps. Both sides derive the rows from the same pure schedule, so sends
and receives pair up. Every rank walks all steps t = 1..P-1 in the same order, posting step t+1's
K/V before step t's gradients (posting nothing where it has nothing), so the p2p operations
between two ranks are posted in the same order on both, as NCCL requires (it ignores tags). The transfer of the next needed step is in flight while the current
block computes (two receive buffers, as in Note [Overlap and double buffering] in ring.py).

Backward is the mirror image: the rows of dK/dV (fp32) computed on a received block go straight
back to its owner at the same step, which adds them to its own gradient; no accumulator travels.
Received rows land in full-length ``[seq, batch, heads, dim]`` buffers (a row range is then one
contiguous piece), whose unread rows are never touched.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.instrument import wait_all
from megatron_ring.attention.schedule import RankSchedule, StepPlan

_KV_TAG, _GRAD_TAG = 2, 3
_Grads = Sequence[tuple[StepPlan, torch.Tensor, torch.Tensor]]


class DirectP2P:
    """Point-to-point transfers of exactly the rows a :class:`RankSchedule` reads (Note above)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, schedule: RankSchedule) -> None:
        self.group, self.rank, self.size, self.schedule = group, rank, size, schedule
        self._steps = list(range(1, size))  # every rank walks every step: see the Note on ordering
        self._sent_steps = self._sent_bytes = 0
        self._grads: torch.Tensor | None = None
        self._outgoing: torch.Tensor | None = None
        self._grad_work: list[dist.Work] = []
        self._grad_in: tuple[slice, torch.Tensor] | None = None

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def _post(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
              tag: int) -> list[dist.Work]:
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group, tag) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group, tag) for p, t in recvs]
        if sends:
            self._sent_steps += 1
            self._sent_bytes += sum(t.numel() * t.element_size() for _, t in sends)
        return dist.batch_isend_irecv(ops) if ops else []

    def take_traffic(self) -> tuple[int, int]:
        """``(steps, bytes)`` this rank sent since the last call."""
        traffic = (self._sent_steps, self._sent_bytes)
        self._sent_steps = self._sent_bytes = 0
        return traffic

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(src, k_src, v_src)`` (``[batch, heads_kv, seq_local, head_dim]``) for the blocks
        this rank's plans read, its own first; only their used rows hold data."""
        own = (k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3))  # [seq, batch, heads, dim] views
        buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # two slots, allocated on first use

        def post(i: int) -> list[dist.Work]:
            t = self._steps[i]
            send_rows, recv_rows = self.schedule.send_rows[t], self.schedule.recv_rows[t]
            sends = [] if send_rows is None else [((self.rank + t) % self.size, x[send_rows].contiguous()) for x in own]
            recvs = []
            if recv_rows is not None:
                if i % 2 not in buffers:
                    buffers[i % 2] = (torch.empty_like(own[0], memory_format=torch.contiguous_format),
                                      torch.empty_like(own[1], memory_format=torch.contiguous_format))
                recvs = [((self.rank - t) % self.size, x[recv_rows]) for x in buffers[i % 2]]
            return self._post(sends, recvs, _KV_TAG)

        works = post(0) if self._steps else []
        if self.schedule.recv_rows[0] is not None:
            yield self.rank, k, v
        for i, t in enumerate(self._steps):
            wait_all(works, k.device)
            works = post(i + 1) if i + 1 < len(self._steps) else []
            if self.schedule.recv_rows[t] is not None:
                kb, vb = buffers[i % 2]
                yield (self.rank - t) % self.size, kb.permute(1, 2, 0, 3), vb.permute(1, 2, 0, 3)
            if self._grads is not None:
                self._exchange_grads(t)
        wait_all(works, k.device)

    def start_grads(self, kv_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        """Start a backward pass; ``kv_shape`` is ``[2, batch, heads_kv, seq_local, head_dim]``."""
        self._grads = torch.zeros(kv_shape, dtype=dtype, device=device)
        self._outgoing, self._grad_work, self._grad_in = None, [], None

    def add_grads(self, src: int, grads: _Grads) -> None:
        """This step's dK/dV pieces ``(plan, dk, dv)`` for block ``src``: kept if it is this rank's
        own block, else gathered into the rows sent back to ``src`` after the step."""
        assert self._grads is not None
        if src == self.rank:
            for plan, dk, dv in grads:
                self._grads[0][:, :, plan.k] += dk
                self._grads[1][:, :, plan.k] += dv
            return
        rows = self.schedule.recv_rows[(self.rank - src) % self.size]
        assert rows is not None
        shape = list(self._grads.shape)
        shape[3] = rows.stop - rows.start
        out = torch.zeros(shape, dtype=self._grads.dtype, device=self._grads.device)
        for plan, dk, dv in grads:
            k = slice(plan.k.start - rows.start, plan.k.stop - rows.start)
            out[0][:, :, k] += dk
            out[1][:, :, k] += dv
        self._outgoing = out

    def _land_grads(self) -> None:
        """Wait for the previous gradient exchange and add what came home."""
        assert self._grads is not None
        wait_all(self._grad_work, self._grads.device)
        if self._grad_in is not None:
            rows, buf = self._grad_in
            self._grads[:, :, :, rows] += buf
        self._grad_work, self._grad_in = [], None

    def _exchange_grads(self, t: int) -> None:
        """Step t's gradients: send what this rank computed on block ``rank - t`` home, receive what
        rank ``rank + t`` computed on this rank's block."""
        assert self._grads is not None
        self._land_grads()
        sends = [] if self._outgoing is None else [((self.rank - t) % self.size, self._outgoing)]
        recvs = []
        rows = self.schedule.send_rows[t]
        if rows is not None:
            shape = list(self._grads.shape)
            shape[3] = rows.stop - rows.start
            self._grad_in = (rows, torch.empty(shape, dtype=self._grads.dtype, device=self._grads.device))
            recvs = [((self.rank + t) % self.size, self._grad_in[1])]
        self._grad_work = self._post(sends, recvs, _GRAD_TAG)
        self._outgoing = None

    def finish_grads(self) -> torch.Tensor:
        """This rank's own ``[2, batch, heads_kv, seq_local, head_dim]`` gradient, everything home."""
        assert self._grads is not None
        self._land_grads()
        grads, self._grads = self._grads, None
        return grads
