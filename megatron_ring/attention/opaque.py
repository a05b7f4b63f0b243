"""How an attention call crosses into its custom op under torch.compile (Note [torch.compile] in ops.py).

A custom op's schema takes tensors, optional tensors and scalars; ``ring_attention`` and ``decode_attention`` also take
a process group and keyword arguments that grow over time. They cross as two strings, both built by dynamo while tracing
(constants of the graph): the group's c10d name (``""`` for None) and the ``repr`` of a dict of the keyword arguments,
which the op reads back with ``ast.literal_eval``. Tensor keyword arguments travel as one list of optional tensors,
their names in the dict under ``"tensors"``. A new keyword argument of an entry point is one more dict entry at its call
of :func:`call_op`; the op's schema does not change.
"""
from __future__ import annotations

import ast
import functools
from typing import Any

import torch
import torch.distributed as dist

LITERALS = (bool, int, float, str, type(None))


def _literal(value: object) -> bool:
    """Whether ``value`` survives ``repr`` + ``ast.literal_eval`` unchanged (tuples of literals too)."""
    if isinstance(value, tuple):
        return all(_literal(item) for item in value)
    return type(value) in LITERALS  # not a SymFloat/SymInt, which has no literal while dynamo traces


def call_op(name: str, tensors: tuple[object, ...], group: object, extras: dict[str, object],
            options: dict[str, object]) -> Any:
    """``torch.ops.megatron_ring.<name>(*tensors, extras, group name, options)``, or None when an
    argument cannot cross (a non-tensor input, a group that is not a ProcessGroup, an option that
    is not a literal): the caller then runs its eager code, which rejects such arguments with a
    TypeError/ValueError on every rank alike (dynamo breaks the graph there)."""
    if not (all(isinstance(t, torch.Tensor) for t in tensors)
            and all(t is None or isinstance(t, torch.Tensor) for t in extras.values())
            and all(_literal(value) for value in options.values())
            and (group is None or isinstance(group, dist.ProcessGroup))):
        return None
    group_name = "" if group is None else group.group_name
    op = getattr(torch.ops.megatron_ring, name)
    return op(*tensors, list(extras.values()), group_name, repr({**options, "tensors": tuple(extras)}))


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> tuple[tuple[str, Any], ...]:
    return tuple(ast.literal_eval(text).items())


def read_call(group_name: str, options: str,
              extras: list[torch.Tensor | None]) -> tuple[dist.ProcessGroup | None, dict[str, Any]]:
    """The process group and keyword arguments (tensor ones included) that :func:`call_op` sent."""
    kwargs = dict(_parse(options))
    kwargs.update(zip(kwargs.pop("tensors"), extras))
    group = dist.distributed_c10d._resolve_process_group(group_name) if group_name else None
    return group, kwargs
