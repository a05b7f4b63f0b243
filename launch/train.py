"""Entry point for launchers: one training rank (logic in megatron_ring.training.loop).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 launch/train.py --deepspeed_config configs/deepspeed/train_cp2.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 launch/train.py --deepspeed_config configs/deepspeed/train_tp2_cp2.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 launch/train.py --deepspeed_config configs/deepspeed/train_hf_cp2.json
    torchrun --nproc_per_node 4 launch/train.py --deepspeed_config configs/deepspeed/train_cp2.json
    torchrun --nproc_per_node 4 launch/train.py configs/train/megatron_pp2_cp2.yaml   # Megatron-LM's names
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ring.training.loop import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())
