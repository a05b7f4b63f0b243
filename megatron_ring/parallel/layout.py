"""ParallelLayout: the sizes of tensor, context, data and pipeline parallelism and the rank grid.

Pure Python. Ranks follow Megatron-core's default order ``tp-cp-ep-dp-pp`` (expert parallel
size 1), fastest-varying first::

    global_rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))

so a group built from :meth:`ParallelLayout.groups` holds the same ranks as the Megatron group of
the same name for the same sizes.

Hierarchical context parallelism (``comm="a2a+p2p"``): ``cp_a2a = A`` splits every CP group of
``cp = A x R`` ranks into a2a groups of A adjacent CP ranks (one node) and ring groups of R ranks
strided by A, as Megatron's ``hierarchical_context_parallel_sizes = [A, R]`` does::

    cp = 4, cp_a2a = 2:   cp ranks 0 1 2 3   a2a groups [0, 1] [2, 3]   ring groups [0, 2] [1, 3]
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp")
"""Axis names, fastest-varying first (Megatron's ``tp-cp-ep-dp-pp`` with ep = 1)."""
HIERARCHICAL_LEVELS: tuple[str, ...] = ("cp-a2a", "cp-ring")
"""The two levels of hierarchical CP, inner first."""


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ParallelLayout.{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"ParallelLayout.{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Sizes of the four parallel axes, keyword-only and in rank order; validated on construction."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    cp_a2a: int | None = None
    """Size of the inner all-to-all groups of hierarchical CP (``a2a+p2p``); a divisor of ``cp``, or None."""

    def __post_init__(self) -> None:
        for name in AXES:
            _check_size(name, getattr(self, name))
        if self.cp_a2a is not None:
            _check_size("cp_a2a", self.cp_a2a)
            if self.cp % self.cp_a2a:
                raise ValueError(f"ParallelLayout.cp_a2a ({self.cp_a2a}) must divide cp ({self.cp}): cp = cp_a2a x "
                                 "ring size (Megatron's hierarchical_context_parallel_sizes)")

    @property
    def cp_ring(self) -> int | None:
        """Ring size of hierarchical CP (``cp // cp_a2a``), None without it."""
        return None if self.cp_a2a is None else self.cp // self.cp_a2a

    def hierarchical_groups(self, level: str) -> list[list[int]]:
        """The ``"cp-a2a"`` groups (A adjacent CP ranks) or ``"cp-ring"`` groups (R ranks strided by A)
        of every CP group, as lists of global ranks; ValueError without ``cp_a2a``."""
        if self.cp_a2a is None:
            raise ValueError("ParallelLayout.cp_a2a is None: no hierarchical CP groups (set cp_a2a, e.g. 2 of cp=4)")
        a, r = self.cp_a2a, self.cp // self.cp_a2a
        if level not in HIERARCHICAL_LEVELS:
            raise ValueError(f"level must be one of {list(HIERARCHICAL_LEVELS)}, got {level!r}")
        out = []
        for cp in self.groups("cp"):
            if level == "cp-a2a":
                out += [cp[j * a:(j + 1) * a] for j in range(r)]
            else:
                out += [cp[i::a] for i in range(a)]
        return sorted(out)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def sizes(self) -> dict[str, int]:
        """``{"tp": .., "cp": .., "dp": .., "pp": ..}`` in rank order."""
        return {name: getattr(self, name) for name in AXES}

    def describe(self) -> str:
        """``tp=8 x cp=1 x dp=1 x pp=2 = 16``: every factor and the product, for error messages."""
        factors = " x ".join(f"{n}={s}" for n, s in self.sizes().items())
        hier = "" if self.cp_a2a is None else f" (cp = a2a {self.cp_a2a} x ring {self.cp_ring})"
        return f"{factors} = {self.world_size}{hier}"

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError naming both numbers when the layout does not fill ``world_size`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"layout world size {self.world_size} ({self.describe()}) != process world size {world_size}; "
                "choose sizes whose product is the number of launched ranks"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates ``{"tp": i, "cp": j, "dp": k, "pp": l}`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size}) for layout {self.describe()}")
        out = {}
        for name in AXES:
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return out

    def rank(self, **coords: int) -> int:
        """Global rank of the given coordinates (missing axes are 0)."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axis {sorted(unknown)}; allowed: {list(AXES)}")
        rank, stride = 0, 1
        for name in AXES:
            size, index = getattr(self, name), coords.get(name, 0)
            if not 0 <= index < size:
                raise ValueError(f"{name} coordinate {index} outside [0, {size})")
            rank += index * stride
            stride *= size
        return rank

    def _axis_names(self, axis: str) -> list[str]:
        """The axes of ``axis`` (``"dp-cp"`` -> ``["dp", "cp"]``); ValueError for an unknown or repeated one."""
        names = axis.split("-")
        bad = [n for n in names if n not in AXES]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"axis {axis!r} is not one of {list(AXES)} or a '-'-joined set of them")
        return names

    def _members(self, base: dict[str, int], names: list[str]) -> list[int]:
        """Sorted global ranks at coordinates ``base`` with every value of the axes ``names``."""
        return sorted(self.rank(**base, **dict(zip(names, varying)))
                      for varying in itertools.product(*(range(getattr(self, n)) for n in names)))

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` as lists of global ranks.

        ``axis`` is one of ``tp``, ``cp``, ``dp``, ``pp`` or several joined by ``-`` (``"dp-cp"``,
        ``"tp-cp"``): ranks that differ only in those coordinates form one group. Groups are listed
        by increasing smallest rank; members by increasing rank, which is Megatron's ring order.
        Linear in the world size.
        """
        names = self._axis_names(axis)
        fixed = [n for n in AXES if n not in names]
        result = [self._members(dict(zip(reversed(fixed), fixed_idx)), names)
                  for fixed_idx in itertools.product(*(range(getattr(self, n)) for n in reversed(fixed)))]
        return sorted(result)

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group along ``axis`` that holds ``rank``, built from its coordinates (its size, not the world)."""
        names = self._axis_names(axis)
        coords = self.coords(rank)
        return self._members({n: c for n, c in coords.items() if n not in names}, names)

    def ring_neighbours(self, rank: int, axis: str = "cp") -> tuple[int, int]:
        """``(previous, next)`` of ``rank`` in its ring along one ``axis`` (members in rank order, wrapping)."""
        if axis not in AXES:
            raise ValueError(f"axis {axis!r} is not one of {list(AXES)}")
        coords, size = self.coords(rank), getattr(self, axis)
        return tuple(self.rank(**{**coords, axis: (coords[axis] + step) % size}) for step in (-1, 1))  # type: ignore
