"""Ring attention demo: ``torchrun --nproc_per_node 4 launch/ring_demo.py`` (logic in megatron_ring.demo)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ring.demo import demo_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(demo_main())
