"""Hardware profiles for the planner: the numbers live in ``megatron_ring/profiles/*.json``.

A profile is data, not code: copy one of the JSON files, edit the numbers (peak FLOP/s per dtype,
HBM size and bandwidth, link bandwidths, achieved-efficiency factors, latencies) and pass its path
to ``megatron-ring plan --hardware my.json``. Unknown keys are rejected with a did-you-mean.

Peak numbers are the vendor's; the ``*_efficiency`` factors turn them into achieved numbers and are
the knobs to calibrate against measurements (``megatron-ring bench attention`` prints them for CPU).
``megatron-ring calibrate`` (:mod:`megatron_ring.perf.planner.calibrate`) measures all of them on the
machine it runs on and writes a profile; its optional fields (collective bandwidths, fixed host
overheads) default to values that leave older profiles' predictions unchanged. The derivation of
achieved FLOP/s, link bandwidth and :class:`CommCosts` from these numbers is the core's
(:func:`~megatron_ring.costs.comm_choice.profile_costs`), which ``comm="auto"`` also uses.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from megatron_ring.costs.comm_choice import PROFILE_DIR, CommCosts, achieved_flops, link_bytes_per_s, profile_costs
from megatron_ring.config.strict import ConfigError, StrictModel, load_mapping

DEFAULT_PROFILE = "h100-sxm"
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


class HardwareProfile(StrictModel):
    """One device (GPU, or for CPU profiles one core) and the links between devices."""

    name: str
    description: str
    memory_bytes: float = Field(gt=0, description="memory per device (bytes)")
    usable_memory_fraction: float = Field(gt=0, le=1, description="share usable by tensors (context, fragmentation)")
    hbm_bytes_per_s: float = Field(gt=0, description="peak memory bandwidth per device")
    peak_flops: dict[str, float] = Field(description="peak dense FLOP/s per device by dtype (fp32, bf16, fp16)")
    matmul_efficiency: float = Field(gt=0, le=1, description="achieved / peak for large GEMMs")
    attention_efficiency: float = Field(gt=0, le=1, description="achieved / peak for the attention block kernel")
    hbm_efficiency: float = Field(gt=0, le=1, description="achieved / peak memory bandwidth")
    devices_per_node: int = Field(ge=1, description="devices joined by the fast (intra-node) links")
    intra_node_bytes_per_s: float = Field(gt=0, description="per device, per direction, inside a node")
    inter_node_bytes_per_s: float = Field(gt=0, description="per device, per direction, between nodes")
    link_efficiency: float = Field(gt=0, le=1, description="achieved / peak link bandwidth")
    p2p_latency_s: float = Field(ge=0, description="fixed cost of one ring step (send/recv + launch + merge)")
    collective_latency_s: float = Field(ge=0, description="fixed cost of one small collective")
    cpu_cores: int | None = Field(default=None, ge=1, description="CPU profiles: cores shared by all ranks; "
                                                                  "peak_flops is then per core and "
                                                                  "hbm_bytes_per_s the whole machine's")
    allreduce_bytes_per_s: float | None = Field(
        default=None, gt=0, description="all-reduce bus bandwidth inside a node: t = latency + 2 (n-1)/n x bytes "
                                        "/ this; None: the intra-node link")
    allgather_bytes_per_s: float | None = Field(
        default=None, gt=0, description="all-gather bandwidth inside a node: t = latency + (n-1) x bytes per rank "
                                        "/ this; None: the intra-node link")
    allgather_latency_s: float | None = Field(default=None, ge=0, description="fixed cost of one small all-gather; "
                                                                              "None: collective_latency_s")
    layer_overhead_s: float = Field(default=0.0, ge=0, description="host time of one transformer layer's forward "
                                                                   "that does not grow with its size (Python, "
                                                                   "dispatch, launches), per pass")
    step_overhead_s: float = Field(default=0.0, ge=0, description="the same for the rest of one forward pass "
                                                                  "(embedding, final norm, LM head, sampling)")

    @field_validator("peak_flops")
    @classmethod
    def _known_dtypes(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(DTYPE_BYTES))
        if unknown:
            raise ValueError(f"unknown dtype {unknown}; allowed: {sorted(DTYPE_BYTES)}")
        if any(v <= 0 for v in value.values()):
            raise ValueError(f"every peak FLOP/s must be > 0, got {value}")
        return value

    @classmethod
    def load(cls, name_or_path: str | Path = DEFAULT_PROFILE) -> "HardwareProfile":
        """A bundled profile by name (see :func:`profile_names`) or a JSON file by path."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILE_DIR / f"{name_or_path}.json"
            if not path.is_file():
                raise ConfigError(f"hardware profile {str(name_or_path)!r} not found; bundled profiles: "
                                  f"{profile_names()}; or give the path of a JSON file")
        return cls.parse(load_mapping(path), where=f"hardware profile {str(path)!r}")

    def flops(self, dtype: str, *, kind: str, ranks: int = 1) -> float:
        """Achieved FLOP/s of one rank for ``kind`` ("matmul" or "attention") when ``ranks`` ranks run at once.

        On GPU profiles each rank owns a device. On CPU profiles the ``cpu_cores`` are shared:
        a rank gets ``cpu_cores / ranks`` cores (at most all of them).
        """
        return achieved_flops(self.model_dump(), dtype, kind=kind, ranks=ranks)

    def hbm(self, *, ranks: int = 1) -> float:
        """Achieved memory bandwidth of one rank when ``ranks`` ranks run at once (CPU ranks share the machine's)."""
        share = 1.0 if self.cpu_cores is None else 1.0 / max(1, ranks)
        return self.hbm_bytes_per_s * self.hbm_efficiency * share

    def host_slowdown(self, *, ranks: int = 1) -> float:
        """How much slower host-bound work of one rank runs when ``ranks`` ranks share the CPU cores (1 on GPUs)."""
        return 1.0 if self.cpu_cores is None else max(1.0, ranks / self.cpu_cores)

    def collective_s(self, kind: str, nbytes: float, ranks: int, *, cross_node: bool) -> float:
        """Time of one ``kind`` ("all_reduce" of an ``nbytes`` buffer, or "all_gather" of ``nbytes`` per
        rank) over ``ranks`` ranks; 0 for one rank."""
        if ranks == 1:
            return 0.0
        link = self.link_bytes_per_s(cross_node=cross_node)
        if kind == "all_reduce":
            bw = link if cross_node or self.allreduce_bytes_per_s is None else self.allreduce_bytes_per_s
            return self.collective_latency_s + 2.0 * (ranks - 1) / ranks * nbytes / bw
        if kind == "all_gather":
            bw = link if cross_node or self.allgather_bytes_per_s is None else self.allgather_bytes_per_s
            latency = self.collective_latency_s if self.allgather_latency_s is None else self.allgather_latency_s
            return latency + (ranks - 1) * nbytes / bw
        raise ValueError(f"kind must be 'all_reduce' or 'all_gather', got {kind!r}")

    def link_bytes_per_s(self, *, cross_node: bool) -> float:
        """Achieved bytes/s per direction of one device's link inside a node or between nodes."""
        return link_bytes_per_s(self.model_dump(), cross_node=cross_node)

    def usable_memory(self, *, ranks: int = 1) -> float:
        """Bytes per rank that tensors may use (CPU profiles share the memory among ``ranks``)."""
        share = 1 if self.cpu_cores is None else max(1, ranks)
        return self.memory_bytes * self.usable_memory_fraction / share

    def comm_costs(self, dtype: str = "bf16", *, cross_node: bool = False, ranks: int = 1) -> CommCosts:
        """The :class:`CommCosts` of this profile, for ``comm="auto"`` and the planner's ring model."""
        return profile_costs(self.model_dump(), dtype, cross_node=cross_node, ranks=ranks)


def profile_names() -> list[str]:
    """Names of the bundled profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
