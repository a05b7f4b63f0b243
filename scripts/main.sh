#!/usr/bin/env bash
# The main job on CPU processes: the paper's two setups at CPU scale under the deepspeed launcher
# (TP2·PP2 baseline vs ring attention over CP=4), side by side, after a look at the layout and a
# ring-attention check against float64.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu
.venv/bin/megatron-ring layout --tp 2 --cp 4 --pp 2
.venv/bin/megatron-ring demo --nproc 4 --seq-len 4096
.venv/bin/megatron-ring compare cpu
