"""A call of ``ring_attention`` or ``decode_attention``, checked: where it runs, the checks at the boundary, the
frozen record of a ring call, and the one prepare step both entry points share.

:func:`cp_place` finds this process in the call's groups (:class:`CPPlace`). :func:`prepare` runs a call's local
checks (every TypeError/ValueError names the field, its value and what is allowed), then the cross-rank handshake
(Note [Cross-rank handshake] in handshake.py), and raises on every rank alike, before any data moves. For
``ring_attention`` the checks build a :class:`RingCall`: the place, the comm (``"auto"`` resolved), the block kernel,
its pieces of work (:class:`~megatron_ring.attention.schedule.Piece`, Note [Pieces] in ring.py) and the relay's
pieces per hop (Note [Pieces per hop] in costs/comm_choice.py).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from megatron_ring.attention.block import resolve_backend
from megatron_ring.attention.comms import A2A_COMMS, COMM_CHOICES, FLAT_COMMS, Comm
from megatron_ring.attention.dilated import Pairs, check_dilation, dilation_code, show_dilation
from megatron_ring.attention.dilated_schedule import dilated_schedule_for
from megatron_ring.attention.handshake import (
    DTYPES, Field, agree_place, choice_field, field, flag_field, scale_field, tensor_fields,
)
from megatron_ring.attention.schedule import Piece, Schedule, schedule_for
from megatron_ring.attention.sharding import SHARDINGS, doc_lengths
from megatron_ring.costs import comm_choice
from megatron_ring.costs.comm_choice import choose_comm_for_shapes, relay_pieces_for

Record = TypeVar("Record")
Level = tuple["dist.ProcessGroup | None", int, int]
"""One level of hierarchical CP: (group, this rank in it, its size)."""


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in ``group``; (0, 1) when torch.distributed is not initialised. ValueError,
    before any collective, when this process is not a member of ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group "
                         "(torch.distributed.get_rank(group) is -1); call it only on the group's members")
    return rank, dist.get_world_size(group)


@dataclass(frozen=True)
class CPPlace:
    """Where this process sits for one call: the flat CP group and/or the two hierarchical ones."""

    rank: int
    size: int
    flat: dist.ProcessGroup | None
    has_flat: bool
    hier: tuple[Level, Level] | None
    """``((a2a group, rank, size), (ring group, rank, size))`` when hierarchical groups were given."""

    def comms(self) -> tuple[str, ...]:
        """The comms these groups can run (``auto`` chooses among them)."""
        return (FLAT_COMMS if self.has_flat else ()) + (("a2a+p2p",) if self.hier is not None else ())

    def levels(self, comm: str) -> tuple[Level, Level]:
        """``(a2a level, ring level)`` of an a2a comm: ``"a2a"`` is the flat group and a ring of one."""
        if comm == "a2a":
            return (self.flat, self.rank, self.size), (None, 0, 1)
        assert self.hier is not None
        return self.hier

    def a2a_size(self, comm: str) -> int:
        return self.levels(comm)[0][2]


def cp_place(group: object, comm: str) -> CPPlace:
    """Resolve ``ring_attention``'s ``group`` for ``comm``; ValueError naming ``group`` when it cannot serve it."""
    if isinstance(group, tuple):
        if len(group) not in (2, 3):
            raise ValueError(f"group as a tuple must be (a2a_group, ring_group) or CPGroups, got {len(group)} items")
        (ga, ra, a), (gr, rr, r) = ((g, *group_rank_size(g)) for g in group[:2])
        flat = group[2] if len(group) == 3 else None
        if flat is not None:
            rank, size = group_rank_size(flat)
            if (rank, size) != (rr * a + ra, a * r):
                raise ValueError(f"CPGroups: cp rank {rank} of {size} is not ring rank {rr} x a2a size {a} + a2a rank "
                                 f"{ra} (of cp {a} x {r}); a2a groups must be adjacent CP ranks")
        place = CPPlace(rr * a + ra, a * r, flat, flat is not None, ((ga, ra, a), (gr, rr, r)))
    else:
        rank, size = group_rank_size(group)  # type: ignore[arg-type]
        place = CPPlace(rank, size, group, True, None)  # type: ignore[arg-type]
    if comm != "auto" and comm not in place.comms():
        if comm == "a2a+p2p":
            raise ValueError("comm='a2a+p2p' needs group=(a2a_group, ring_group) or a CPGroups (e.g. "
                             "init_parallel(...).cp_groups), got a single process group")
        if comm in FLAT_COMMS:
            raise ValueError(f"comm={comm!r} needs the whole CP group: pass group=<cp group> or "
                             "CPGroups(a2a, ring, cp) with cp set")
    return place


def check_qkv(q: object, k: object, v: object, *, same_seq: bool) -> None:
    """Validate ``[batch, seq, heads, head_dim]`` q/k/v (``same_seq``: q and k/v share seq length)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}.dtype is {t.dtype}; allowed: {[str(d) for d in DTYPES]}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    for name, t, dim, what in (("q", q, 2, "heads_q"), ("k", k, 2, "heads_kv"), ("q", q, 3, "head_dim")):
        if t.shape[dim] == 0:
            raise ValueError(f"{name} has {what} = 0; {what} must be >= 1")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[3]}, k/v have {k.shape[3]}")
    if same_seq and q.shape[1] != k.shape[1]:
        raise ValueError(f"seq_local mismatch: q has {q.shape[1]}, k/v have {k.shape[1]}; the ring needs equal local lengths")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"heads_q ({q.shape[2]}) must be divisible by heads_kv ({k.shape[2]}) for grouped-query attention"
        )


def check_tokens(q: torch.Tensor, seq_name: str, entry: str, rule: str) -> None:
    """Raise ValueError if q ``[batch, seq, heads, head_dim]`` has no token (``seq_name`` = 0)."""
    if q.shape[1] == 0:
        raise ValueError(f"q has {seq_name} = 0; {entry} needs {rule} ({seq_name} >= 1)")


def check_key_padding_mask(mask: object, k: torch.Tensor) -> None:
    """Validate a key padding mask: None, or bool ``[batch, seq]`` matching k's batch, seq and device."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask.dtype is {mask.dtype}; allowed: torch.bool (True = a real token)")
    if tuple(mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"key_padding_mask must be [batch, seq] = {(k.shape[0], k.shape[1])} like k, "
                         f"got shape {tuple(mask.shape)}")
    if mask.device != k.device:
        raise ValueError(f"key_padding_mask must be on k's device {k.device}, got {mask.device}")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_window(window_size: object, name: str = "window_size") -> tuple[int, int]:
    """``window_size`` as ``(left, right)``; ValueError unless it is a pair of ints >= -1."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
            isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        raise ValueError(f"{name} must be a pair (left, right) of ints >= -1 (-1 = unbounded), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"{name} must be a pair (left, right) of ints >= -1 (-1 = unbounded), got {window_size!r}")
    return left, right


def check_scale(softmax_scale: object, head_dim: int) -> float:
    """The softmax scale: ``softmax_scale`` (a positive number) or ``1/sqrt(head_dim)`` for None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def check_a2a_heads(heads_q: int, a2a_size: int, comm: str) -> None:
    """ValueError naming ``heads_q`` unless the query heads split evenly over the a2a group."""
    if heads_q % a2a_size:
        what = "cp size" if comm == "a2a" else "a2a group size"
        raise ValueError(f"heads_q ({heads_q}) must be divisible by the {what} ({a2a_size}) for comm={comm!r}: "
                         f"the all-to-all gives each rank heads_q / {a2a_size} query heads; use comm='p2p' or "
                         "a smaller all-to-all group")


def packed_as_batch(q: object, k: object, v: object, key_padding_mask: object,
                    cu_seqlens: object) -> tuple[object, object, object, object]:
    """With ``cu_seqlens``: packed ``[tokens_local, heads, head_dim]`` q/k/v (and a ``[tokens_local]``
    mask) as a batch of one, ``[1, tokens_local, heads, head_dim]``; without, the inputs unchanged."""
    if cu_seqlens is None:
        return q, k, v, key_padding_mask
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(f"with cu_seqlens, {name} must be packed 3-D [tokens_local, heads, head_dim], "
                             f"got shape {tuple(t.shape)}")
    if isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dim() != 1:
        raise ValueError(f"with cu_seqlens, key_padding_mask must be 1-D [tokens_local], "
                         f"got shape {tuple(key_padding_mask.shape)}")
    return tuple(t.unsqueeze(0) if isinstance(t, torch.Tensor) else t  # type: ignore[return-value]
                 for t in (q, k, v, key_padding_mask))


def prepare(entry: str, place: CPPlace, check_consistency: bool, hint: object,
            build: Callable[[], tuple[Record, list[Field]]]) -> Record:
    """The prepare step of both entry points: ``build`` runs the local checks and returns the call's
    record and its handshake fields; then, with ``check_consistency``, every rank of ``place``
    compares its fields with the others'. A rank whose checks failed still joins the handshake (as
    rejected) before raising its own error, so no rank waits in a collective."""
    built: tuple[Record, list[Field]] | None = None
    error: Exception | None = None
    try:
        built = build()
    except Exception as err:  # raised below, once the other ranks know
        error = err
    if check_consistency and place.size > 1:
        agree_place(entry, None if built is None else built[1], place, hint,
                    "" if error is None else f"{type(error).__name__}: {error}")
    if built is None:
        assert error is not None
        raise error
    return built[0]


@dataclass(frozen=True)
class RingCall:
    """A checked ``ring_attention`` call; q/k/v are ``[batch, seq_local, heads, head_dim]`` (packed
    documents as a batch of one)."""

    place: CPPlace
    comm: Comm
    """The comm that runs (``"auto"`` resolved)."""
    causal: bool
    sharding: str
    scale: float
    backend: str
    """The block kernel (resolved)."""
    masked: bool
    """Whether a key padding mask was given."""
    pieces: tuple[Piece, ...]
    """The call's work: one whole piece, or a dilated call's pieces (Note [Pieces] in ring.py)."""
    dilation: Pairs | None = None
    """Dilated attention's ``(segment_length, dilation)`` pairs (dilated.py), or None."""
    relay_pieces: int = 1
    """The relay's head groups per forward hop (Note [Forward memory] in relay.py): ``comm_choice.PIECES`` when set,
    else the cost model's choice for this call's ring (Note [Pieces per hop] in costs/comm_choice.py)."""

    @property
    def schedule(self) -> Schedule:
        """The schedule of a call of one whole piece (every call but a dilated one)."""
        assert self.dilation is None, "a dilated call has one schedule per piece"
        return self.pieces[0].schedule


def whole_piece(schedule: Schedule, heads_q: int, heads_kv: int) -> Piece:
    """The one piece of a plain call: every head, every row."""
    return Piece(slice(0, heads_q), slice(0, heads_kv), ((slice(0, heads_q), slice(0, heads_kv)),), schedule)


def _docs_code(cu_seqlens: torch.Tensor | None) -> int:
    """0 without ``cu_seqlens``, else ``n_docs << 32 | crc32(boundaries)`` (for the handshake)."""
    if cu_seqlens is None:
        return 0
    bounds = cu_seqlens.tolist()
    return (len(bounds) - 1) << 32 | zlib.crc32(",".join(map(str, bounds)).encode())


def _show_docs(code: int) -> str:
    return "None" if code == 0 else f"{code >> 32} documents (boundaries crc32 {code & 0xFFFFFFFF:#010x})"


def _relay_pieces(run: str, place: CPPlace, direct: bool, q: torch.Tensor, k: torch.Tensor, causal: bool) -> int:
    """The relay's head groups per forward hop of a call that runs ``run`` (1 where no relay runs: all_gather, or
    direct transfers under windows, documents or dilation): those of ``p2p``'s ring, or of the ring an all-to-all
    comm runs over its ring group (``comm_choice.relay_pieces``)."""
    if run == "all_gather" or direct:
        return 1
    batch, seq_local, heads_q, head_dim = q.shape
    return relay_pieces_for(seq_local, place.size, batch, heads_q, k.shape[2], head_dim, causal, q.element_size(),
                            q.device.type, place.a2a_size(run) if run in A2A_COMMS else 1, comm_choice.PIECES)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""q, k, v and the key padding mask as ``[batch, seq_local, ...]`` (packed documents: a batch of one)."""


def ring_call(q: object, k: object, v: object, place: CPPlace, *, causal: bool, softmax_scale: float | None,
              sharding: str, comm: str, backend: str, key_padding_mask: object = None,
              window_size: object = (-1, -1), cu_seqlens: torch.Tensor | None = None,
              dilation: object = None) -> tuple[tuple[RingCall, Batch], list[Field]]:
    """Every local check of a ``ring_attention`` call: its record, its inputs as a batch, and its
    handshake fields (``comm`` as requested)."""
    q, k, v, key_padding_mask = packed_as_batch(q, k, v, key_padding_mask, cu_seqlens)
    check_qkv(q, k, v, same_seq=True)
    check_tokens(q, "seq_local", "ring_attention", "at least one token per rank")
    check_key_padding_mask(key_padding_mask, k)
    check_choice("sharding", sharding, SHARDINGS)
    check_choice("comm", comm, COMM_CHOICES)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    scale = check_scale(softmax_scale, q.shape[-1])
    window = check_window(window_size)
    pairs = None if dilation is None else check_dilation(dilation, q.shape[2], {  # plain calls stay out of dilated.py
        "window_size": window != (-1, -1), "cu_seqlens": cu_seqlens is not None,
        "key_padding_mask": key_padding_mask is not None, f"comm={comm!r}": comm in A2A_COMMS})
    rank, size, seq_local = place.rank, place.size, q.shape[1]
    docs = None if cu_seqlens is None else doc_lengths(cu_seqlens, seq_local * size, size, sharding)
    schedule = schedule_for(rank, size, seq_local, docs, causal=causal, sharding=sharding, window=window)
    if comm in A2A_COMMS:
        check_a2a_heads(q.shape[2], place.a2a_size(comm), comm)
        if schedule.sparse:
            raise ValueError(f"comm={comm!r} does not support window_size or cu_seqlens; allowed with them: "
                             "'p2p', 'all_gather', 'auto' (which then runs 'p2p')")
    run = comm
    if comm == "auto":  # with a window or documents, p2p moves only the rows the plans read (direct.py)
        run = "p2p" if schedule.sparse or pairs or q.shape[0] == 0 else choose_comm_for_shapes(
            tuple(q.shape), tuple(k.shape), size, causal=causal, element_size=q.element_size(),
            device_type=q.device.type, candidates=place.comms(), a2a_size=place.hier[0][2] if place.hier else None)
    masked = key_padding_mask is not None
    kernel = resolve_backend(backend, q.device, q.dtype, q.shape[-1], masked=masked or schedule.windowed)
    pieces = (whole_piece(schedule, q.shape[2], k.shape[2]),) if pairs is None else dilated_schedule_for(
        rank, size, seq_local, q.shape[2], k.shape[2], pairs, causal=causal, sharding=sharding)
    call = RingCall(place, run, causal, sharding, scale, kernel, masked, pieces, pairs,  # type: ignore[arg-type]
                    _relay_pieces(run, place, schedule.sparse or pairs is not None, q, k, causal))
    docs_code = _docs_code(cu_seqlens)
    fields = [*tensor_fields(q, k, "seq_local"), flag_field("causal", causal),
              choice_field("sharding", sharding, SHARDINGS), choice_field("comm", comm, COMM_CHOICES),
              scale_field(scale), flag_field("key_padding_mask", masked, ("None", "a mask")),
              flag_field("gradients", torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
                         ("not needed", "needed")),
              field("window_size[0]", window[0]), field("window_size[1]", window[1]),
              field("cu_seqlens", docs_code, _show_docs),
              field("dilation", 0 if pairs is None else dilation_code(pairs), show_dilation),
              field("relay_pieces", call.relay_pieces)]  # differs where one rank set comm_choice.PIECES
    return (call, (q, k, v, key_padding_mask)), fields  # type: ignore[return-value]


def prepare_ring(q: object, k: object, v: object, group: object, *, check_consistency: bool,
                 **options: object) -> tuple[RingCall, Batch]:
    """:func:`prepare` of a ``ring_attention`` call over ``group`` (``options``: the keyword
    arguments of :func:`ring_call`): the checked record and the inputs as a batch."""
    place = cp_place(group, options["comm"])  # type: ignore[arg-type]
    return prepare("ring_attention", place, check_consistency, q,
                   lambda: ring_call(q, k, v, place, **options))  # type: ignore[arg-type]
