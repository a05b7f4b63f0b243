"""``python -m megatron_ring.perf.sweep``: the same as ``megatron-ring sweep``."""
import sys

from megatron_ring.perf.sweep.cli import sweep_main

sys.exit(sweep_main())
