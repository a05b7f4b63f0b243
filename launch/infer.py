"""Entry point for launchers: one inference run per rank (logic in megatron_ring.inference.main).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 launch/infer.py --deepspeed_config configs/deepspeed/cpu_ring_cp4.json
    deepspeed --num_gpus 16 launch/infer.py --deepspeed_config configs/deepspeed/paper_ring_cp16.json
    torchrun --nproc_per_node 4 launch/infer.py --deepspeed_config configs/deepspeed/cpu_baseline_tp2_pp2.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ring.inference.main import infer_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(infer_main())
