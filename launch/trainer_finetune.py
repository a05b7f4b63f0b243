"""Entry point for launchers: transformers' Trainer with ring attention (logic in megatron_ring.training.hf_trainer).

    python -m megatron_ring.testing.tiny_hf llama /tmp/tiny-llama
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/trainer_finetune.py --model /tmp/tiny-llama --cp 2 \
        --deepspeed configs/deepspeed/trainer_cp2.json --output_dir /tmp/trainer-cp2 --max_steps 4
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ring.training.hf_trainer import trainer_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(trainer_main())
