"""Cross-rank agreement on a call's arguments before any data moves (``check_consistency=True``).

Note [Cross-rank handshake]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The collectives of ``ring_attention`` and ``decode_attention`` are sized by the call's arguments. If the ranks of a
group disagree (one rank's ``seq_local`` or ``dtype`` differs, one passes ``causal=True``, one a key mask), the
transfers no longer pair up: gloo aborts the process ("Received data size doesn't match"), NCCL hangs or reads garbage,
and a rank may even return a wrong tensor as success. So each call first describes itself as a row of ``WIDTH`` int64s::

    [entry point, valid, batch, seq_local, heads_q, heads_kv, head_dim, dtype, ..., 0 padding]

(dtypes and string choices as indices, ``softmax_scale`` as its float64 bits) and every rank all-gathers the rows of the
group. Every rank then sees the same ``[P, WIDTH]`` table and raises the same ValueError naming each differing field,
its values and the ranks holding each, before any data collective. A rank whose own checks rejected its inputs sends
``valid = 0`` and the first ``REASON_BYTES`` bytes of its error in place of the fields: it raises its own error and the
others raise a ValueError naming it and quoting the reason, so no rank is left waiting in a collective. An integration
whose model failed on one rank before that rank's next attention call sends the same row (:func:`tell_peers`), so its
peers, waiting in that call's handshake, raise at once.

Cost: one all-gather of ``WIDTH * 8 = 192`` bytes per rank per call (one collective latency, tens of microseconds on
NVLink, ~0.1 ms on gloo) and, when the group has no CPU (gloo) backend, one host-device synchronisation to read the
table. Nothing is added per ring step or in backward. The rows are not cached per (group, shapes): a rank whose cache
hit would skip the collective that a rank with a changed shape enters, which is exactly the mismatch to catch. A caller
that knows its ranks agree (a decode loop after its first step, a training step after the first) can pass
``check_consistency=False``; it must then do so on every rank of the group, as the check itself is a collective.

``ring_attention`` also sends whether its output needs gradients (grad mode on and q, k or v requiring them): a rank
that differs would skip the backward ring the others wait in. Not compared: the block ``backend`` (each rank's kernel
computes its own blocks, no collective depends on it) and, in decode, the cache shard length ``s_local``.
"""
from __future__ import annotations

import struct
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron_ring.attention.transport import gather_stacked


class Place(Protocol):
    """What :func:`agree_place` reads of where a call runs (``call.CPPlace``)."""

    size: int
    flat: dist.ProcessGroup | None
    has_flat: bool
    hier: tuple[tuple[dist.ProcessGroup | None, int, int], tuple[dist.ProcessGroup | None, int, int]] | None

WIDTH = 24
"""Int64s per rank in the handshake: entry point, valid flag, up to 22 fields, zero padding."""
REASON_BYTES = (WIDTH - 2) * 8
"""Bytes of a rejected rank's error message that travel in its row (UTF-8, cut, zero-padded)."""
ENTRIES: tuple[str, ...] = ("ring_attention", "decode_attention", "turn_attention")
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes both entry points take."""
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "xpu", "mps", "hpu", "meta", "other")


Field = tuple[str, int, Callable[[int], str]]
"""One compared argument: its name in error messages, its int64 code and how to show a code."""


def field(name: str, code: int, show: Callable[[int], str] = str) -> Field:
    """A compared argument whose code is ``code`` (shown as the number unless ``show`` says otherwise)."""
    return name, code, show


def choice_field(name: str, value: object, allowed: Sequence[object]) -> Field:
    """An argument that is one of ``allowed`` (already validated), sent as its index."""
    return name, list(allowed).index(value), lambda code: repr(allowed[code])


def flag_field(name: str, value: bool, shown: tuple[str, str] = ("False", "True")) -> Field:
    """A two-valued argument; ``shown`` names its values (False, True) in messages."""
    return name, int(value), lambda code: shown[code]


def scale_field(scale: float) -> Field:
    """``softmax_scale`` (the resolved float) sent as its exact float64 bits."""
    return ("softmax_scale", struct.unpack("<q", struct.pack("<d", scale))[0],
            lambda code: repr(struct.unpack("<d", struct.pack("<q", code))[0]))


def tensor_fields(q: torch.Tensor, k: torch.Tensor, seq_name: str | None) -> list[Field]:
    """Shape, dtype and device fields of q ``[batch, seq, heads_q, head_dim]`` and k ``[.., heads_kv, ..]``
    (``seq_name`` None: the query length is not compared)."""
    device = q.device.type if q.device.type in DEVICE_TYPES else "other"
    seq = [] if seq_name is None else [field(seq_name, q.shape[1])]
    return [field("batch", q.shape[0]), *seq, field("heads_q", q.shape[2]), field("heads_kv", k.shape[2]),
            field("head_dim", q.shape[3]), choice_field("dtype", q.dtype, DTYPES),
            choice_field("device", device, DEVICE_TYPES)]


def table_device(group: dist.ProcessGroup | None, hint: object) -> torch.device:
    """Where the rows travel: CPU for groups with a gloo backend, else the inputs' (CUDA) device."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return torch.device("cpu")
    if isinstance(hint, torch.Tensor):
        return hint.device
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks}" if len(ranks) == 1 else f"ranks {ranks}"


def _differs(name: str, column: list[int], show: Callable[[int], str]) -> str | None:
    """``None`` if every rank has the same code, else "<name> differs ...: ranks [..] have .., rank [..] has ..."."""
    holders: dict[int, list[int]] = {}
    for rank, code in enumerate(column):
        holders.setdefault(code, []).append(rank)
    if len(holders) == 1:
        return None
    parts = [f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {show(code)}" for code, ranks in holders.items()]
    return f"{name} differs across the CP group: " + ", ".join(parts)


def _problem(entry: str, fields: Sequence[Field], table: list[list[int]]) -> str | None:
    """What the ranks' rows (``table[rank] = [entry, valid, *codes]``) disagree on, or None."""
    entries = _differs("entry point", [row[0] for row in table], ENTRIES.__getitem__)
    if entries is not None:
        return f"{entries}; every rank of the group must make the same call"
    invalid = [rank for rank, row in enumerate(table) if not row[1]]
    if invalid:
        reasons = "; ".join(f"rank {rank}: {_reason(table[rank])}" for rank in invalid)
        return (f"the inputs were rejected on {_ranks(invalid)} ({reasons}; see the error raised there); {entry} "
                "raises on every rank so that none waits in a collective")
    found = (_differs(name, [row[2 + i] for row in table], show) for i, (name, _, show) in enumerate(fields))
    differing = "; ".join(text for text in found if text is not None)
    if not differing:
        return None
    return f"{differing}. Every rank of the group must pass the same value (check_consistency=False skips this check)"


def _reason_codes(reason: str) -> list[int]:
    """``reason`` as int64 codes: its first :data:`REASON_BYTES` UTF-8 bytes, zero-padded."""
    raw = reason.encode("utf-8")[:REASON_BYTES].ljust(REASON_BYTES, b"\0")
    return list(struct.unpack(f"<{WIDTH - 2}q", raw))


def _reason(row: list[int]) -> str:
    """The error message a rejected row carries (possibly cut)."""
    text = struct.pack(f"<{WIDTH - 2}q", *row[2:]).rstrip(b"\0").decode("utf-8", errors="ignore")
    return text or "no reason sent"


def agree(entry: str, fields: Sequence[Field] | None, group: dist.ProcessGroup | None, size: int,
          hint: object, reason: str = "") -> None:
    """All-gather this rank's row and raise ValueError unless every rank of ``group`` sent the same one. ``fields`` is
    None when this rank's own checks failed: it then only tells the others, with ``reason`` (its error, cut to
    :data:`REASON_BYTES`), and returns, to raise its own error. ``hint``: the caller's q (device of NCCL groups)."""
    codes = _reason_codes(reason) if fields is None else [code for _, code, _ in fields]
    assert len(codes) <= WIDTH - 2, "widen WIDTH for more fields"
    row = torch.zeros(WIDTH, dtype=torch.int64)
    row[: 2 + len(codes)] = torch.tensor([ENTRIES.index(entry), fields is not None, *codes], dtype=torch.int64)
    table = gather_stacked(row.to(table_device(group, hint)), group, size).tolist()
    problem = None if fields is None else _problem(entry, fields, table)
    if problem is not None:
        raise ValueError(f"{entry}: {problem}")


def tell_peers(entry: str, group: dist.ProcessGroup | None, size: int, error: BaseException) -> None:
    """Join the handshake of the ``entry`` call the other ranks of ``group`` wait in, as a rank whose
    inputs were rejected by ``error``: they raise a ValueError naming this rank and quoting it."""
    agree(entry, None, group, size, None, reason=f"{type(error).__name__}: {error}")


def agree_place(entry: str, fields: Sequence[Field] | None, place: Place, hint: object, reason: str = "") -> None:
    """:func:`agree` over the whole CP group of ``place``: its flat group when it has one, else the a2a groups and then
    the ring groups (every rank of the grid is linked to every other through them). A rank whose a2a group disagrees
    enters the ring-group round as rejected (``valid = 0``): every rank raises, none waits in a collective."""
    if place.has_flat:
        agree(entry, fields, place.flat, place.size, hint, reason)
        return
    assert place.hier is not None
    (inner, _, a), (outer, _, r) = place.hier
    inner_error: ValueError | None = None
    if a > 1:
        try:
            agree(entry, fields, inner, a, hint, reason)
        except ValueError as err:
            inner_error = err
    if r > 1:
        agree(entry, None if inner_error is not None else fields, outer, r, hint,
              reason if inner_error is None else str(inner_error))
    if inner_error is not None:
        raise inner_error
