#!/usr/bin/env bash
# The main job on CPU processes: show the paper's two layouts, then run ring attention on 4 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1
.venv/bin/megatron-ring layout --tp 2 --cp 4 --pp 2
.venv/bin/megatron-ring demo --nproc 4 --seq-len 4096
