"""The decode profiler's split of a profiled step (no model, no processes)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ring.perf.bench.decode_profile import step_breakdown


@dataclass
class Event:
    key: str
    count: int
    self_cpu_time_total: float  # microseconds, as torch.profiler reports them


class Profile:
    def key_averages(self) -> list[Event]:
        return [Event("c10d::_allgather_base_", 30, 4000.0), Event("RowParallel", 60, 9000.0),
                Event("aten::mm", 211, 40000.0), Event("aten::_scaled_dot_product_flash_attention_for_cpu", 30, 20000.0),
                Event("aten::cat", 181, 50000.0)]


def test_a_step_splits_into_its_kinds_and_the_python_rest() -> None:
    parts, top = step_breakdown(Profile(), wall_s=0.2)
    assert abs(parts["collectives"] - 0.013) < 1e-9
    assert abs(parts["linear layers"] - 0.04) < 1e-9 and abs(parts["attention"] - 0.02) < 1e-9
    assert abs(parts["other ops"] - 0.05) < 1e-9
    assert abs(parts["python and framework"] - (0.2 - 0.123)) < 1e-9
    assert top[0] == ("aten::cat", 181, 0.05) and len(top) == 5
