"""The one layout schema: the parallel sizes of every config, the planner and the CLI.

Every config file names its sizes in a ``layout`` (or ``parallel``) mapping with the keys ``tp``,
``cp``, ``dp`` and ``pp`` (Megatron's rank order); :class:`LayoutConfig` validates it (strict
integers >= 1, unknown keys with a did-you-mean) and turns it into a
:class:`~megatron_ring.parallel.layout.ParallelLayout`. Sections that restrict an axis subclass it.
"""
from __future__ import annotations

from pydantic import Field

from megatron_ring.config.strict import StrictModel
from megatron_ring.parallel.layout import AXES, ParallelLayout


class LayoutConfig(StrictModel):
    """Sizes of the parallel axes in rank order; their product must be the launched world size."""

    tp: int = Field(1, ge=1, description="tensor parallel size")
    cp: int = Field(1, ge=1, description="context parallel size (the ring)")
    dp: int = Field(1, ge=1, description="data parallel size")
    pp: int = Field(1, ge=1, description="pipeline parallel size")
    cp_a2a: int | None = Field(None, ge=1, description="hierarchical CP (comm a2a+p2p): the all-to-all group size, "
                                                       "a divisor of cp (Megatron's hierarchical_context_parallel_sizes[0])")

    def layout(self) -> ParallelLayout:
        """The :class:`ParallelLayout` of these sizes."""
        return ParallelLayout(**{axis: getattr(self, axis) for axis in AXES}, cp_a2a=self.cp_a2a)
