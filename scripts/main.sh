#!/usr/bin/env bash
# The main job on CPU processes: a look at the layout, then the headline: a real pretrained model
# (SmolLM2-135M-Instruct) answers a question about a real document of the repository (the GPL-3
# text, 6,400 prompt tokens through its chat template), once with DeepSpeed AutoTP tp 2 and once
# with ring attention over cp 2, 2 processes each under the deepspeed launcher, the same attention
# kernel on both sides; prints both answers, whether they are identical, and the speed and memory
# ratios. About 3 minutes on 2 quiet cores with .venv in place.
#   --sweep   also the ring check against float64 and the random-model sweep (tp 2 vs cp 2 at 8k and 16k)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu
.venv/bin/megatron-ring layout --tp 2 --cp 2 --pp 2
.venv/bin/megatron-ring compare smollm2-tp2 --out-dir results/main
echo "results: results/main/smollm2_autotp_tp2.json, results/main/smollm2_ring_cp2.json (answers in generated_text)"
if [ "${1:-}" = "--sweep" ]; then
    .venv/bin/megatron-ring demo --nproc 2 --seq-len 4096
    .venv/bin/megatron-ring sweep long-tp2 --lengths 8192 16384 --repeats 1 --out-dir results/main/sweep
    echo "plots: results/main/sweep/sweep_ratios.png, sweep_latency.png, sweep_memory.png"
fi
echo "stored quiet sweeps (3 repeats, more pairs): docs/results/ and docs/performance.md"
