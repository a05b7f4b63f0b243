"""Where a checkpoint's tensors are read from: a state dict in memory, or safetensors files read a slice at a time.

::

    files = SafetensorsTensors.of(Path("/checkpoint"))      # None: the directory holds no safetensors file
    files.shape("model.embed_tokens.weight")                # (vocab, hidden): from the file's header
    rows = files.read("model.layers.0.self_attn.q_proj.weight", dim=0, start=0, stop=64)   # fp32 [64, hidden]
    files.reads                                             # [(name, dim, start, stop), ...] in order

Both sources answer :class:`TensorSource`: names, shapes, and ``read`` of one slice along one dim as a
float32 tensor of its own. :class:`~megatron_ring.integrations.megatron.hf_weights.HFWeights` reads
through it, so a rank reads only its pipeline stage's tensors and only its TP rows or columns of them.

Note [One tensor's pages at a time]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
safetensors' ``safe_open`` maps the file and ``get_slice`` returns a view of the whole tensor on
that mapping; the pages a copy touches stay resident, and count in the process's RSS, until the
mapping goes. Kept open while a stage reads its layers, the mapping's touched pages would add up
to the stage's share of the file on top of the fp32 copies (measured on SmolLM2-135M: peak 847
MiB instead of 538 for half the layers); opened once per tensor, the embedding's 113 MiB of pages
would still sit beside its copy. :meth:`SafetensorsTensors.read` therefore copies a slice in
blocks of rows of at most :data:`BLOCK_BYTES`, each through a mapping of its own that is released
before the next: at most 16 MiB of the file is resident at a time. A column slice (``dim=1``)
touches every page of the rows it reads (rows are contiguous), a row slice only its rows.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Mapping, Optional, Protocol, runtime_checkable

import torch

BLOCK_BYTES = 16 * 2**20
"""Bytes of a tensor mapped at a time while it is read (Note [One tensor's pages at a time])."""


@runtime_checkable
class TensorSource(Protocol):
    """Named tensors that can be read a slice at a time."""

    def keys(self) -> Iterable[str]:
        """Every tensor name."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` without reading it."""

    def read(self, name: str, dim: int = 0, start: int = 0, stop: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` along ``dim`` (all of it by default): float32 in memory of its
        own, or copied into ``out`` (its shape; any float dtype) and ``out`` returned."""


def _index(ndim: int, dim: int, start: int, stop: Optional[int]) -> tuple[slice, ...]:
    index = [slice(None)] * ndim
    index[dim] = slice(start, stop)
    return tuple(index)


class TensorDict:
    """A :class:`TensorSource` over a state dict in memory (``model.state_dict()``); reads are views, cast to fp32."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, dim: int = 0, start: int = 0, stop: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        tensor = self.tensors[name]
        part = tensor if start == 0 and stop is None else tensor[_index(tensor.dim(), dim, start, stop)]
        return part.float() if out is None else _checked(out, part.shape, name).copy_(part)


def _checked(out: torch.Tensor, shape: Iterable[int], name: str) -> torch.Tensor:
    """``out``, or a ValueError naming ``name`` when ``out`` is not of ``shape``."""
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"the slice of {name!r} has shape {tuple(shape)}, its destination {tuple(out.shape)}")
    return out


class SafetensorsTensors:
    """A :class:`TensorSource` over a checkpoint directory's safetensors files (one file, or several named by
    ``model.safetensors.index.json``): shapes from the headers, each read opens its file and copies only the
    slice asked for (Note [One tensor's pages at a time]). :attr:`reads` records every read."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        from safetensors import safe_open

        self.files = dict(files)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(set(self.files.values())):
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if self.files.get(name) == path:
                        self.shapes[name] = tuple(handle.get_slice(name).get_shape())
        missing = sorted(set(self.files) - set(self.shapes))
        if missing:
            raise ValueError(f"safetensors index names tensors its files do not hold: {missing[:5]}")
        self.reads: list[tuple[str, int, int, Optional[int]]] = []

    @classmethod
    def of(cls, directory: Path) -> Optional["SafetensorsTensors"]:
        """The safetensors files of ``directory``, or None when it holds none."""
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls({name: directory / file for name, file in weight_map.items()})
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            return None
        from safetensors import safe_open

        files: dict[str, Path] = {}
        for path in paths:
            with safe_open(path, framework="pt") as handle:
                files.update((name, path) for name in handle.keys())
        return cls(files)

    def keys(self) -> Iterable[str]:
        return self.shapes.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, dim: int = 0, start: int = 0, stop: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        from safetensors import safe_open

        full = self.shapes[name]
        rows = range(*slice(start, stop).indices(full[dim])) if full else range(0)
        shape = list(full)
        if full:
            shape[dim] = len(rows)
        out = torch.empty(shape, dtype=torch.float32) if out is None else _checked(out, shape, name)
        self.reads.append((name, dim, start, stop))
        if not full:
            with safe_open(self.files[name], framework="pt") as handle:
                return out.copy_(handle.get_tensor(name))
        row_bytes = max(1, math.prod(full[1:]) * 4)  # at most fp32 (F64 is not a checkpoint's dtype here)
        step = max(1, BLOCK_BYTES // row_bytes)
        for lo in range(0, shape[0], step):  # Note [One tensor's pages at a time]: a mapping per block
            hi = min(shape[0], lo + step)
            index = list(_index(len(full), dim, rows.start, rows.stop))
            index[0] = slice(rows.start + lo, rows.start + hi) if dim == 0 else slice(lo, hi)
            with safe_open(self.files[name], framework="pt") as handle:
                out[lo:hi].copy_(handle.get_slice(name)[tuple(index)])
        return out
