#!/usr/bin/env bash
# The main job on CPU processes: a look at the layout, a ring-attention check against float64, then
# the headline: long prompts served by a TP baseline and by ring attention over CP, 2 processes each
# (the same 4-layer GPT, the same fused attention kernel), under the deepspeed launcher, at 8k and
# 16k prompt tokens; prints the table and where the plots are. Takes about 3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu
.venv/bin/megatron-ring layout --tp 2 --cp 2 --pp 2
.venv/bin/megatron-ring demo --nproc 2 --seq-len 4096
.venv/bin/megatron-ring sweep long-tp2 --lengths 8192 16384 --repeats 1 --out-dir results/main
echo "plots: results/main/sweep_ratios.png, results/main/sweep_latency.png, results/main/sweep_memory.png"
echo "stored quiet sweeps (3 repeats, more pairs): docs/results/ and docs/performance.md"
