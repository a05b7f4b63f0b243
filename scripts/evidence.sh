#!/usr/bin/env bash
# The stored evidence of docs/results/: a hardware profile measured on this machine, then one sweep
# per long-context pair (3 alternating repeats per point), each with the planner's predictions on
# that profile. Run it on an idle machine: about an hour on 2 cores. Each sweep.json records the
# command, commit, machine and load average (and says "noisy" when the machine was busy).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu
out=docs/results
ring=.venv/bin/megatron-ring
$ring calibrate --out $out/cpu-calibrated.json --name cpu-calibrated
profile=$out/cpu-calibrated.json
$ring sweep long-tp2 --lengths 2048 4096 8192 16384 32768 --predict $profile --settle 180 --out-dir $out/long-tp2
$ring sweep long-pp2 --lengths 4096 8192 16384 --batches 1 4 --predict $profile --settle 180 --out-dir $out/long-pp2
$ring sweep long-gqa-tp2 --lengths 4096 8192 16384 --predict $profile --settle 180 --out-dir $out/long-gqa-tp2
$ring sweep long-cp4 --lengths 4096 8192 16384 --predict $profile --settle 180 --out-dir $out/long-cp4
$ring sweep long-tp2-cp2 --lengths 4096 8192 16384 --predict $profile --settle 180 --out-dir $out/long-tp2-cp2
.venv/bin/python -m megatron_ring.perf.planner.paper_scale --out $out/paper_scale_plan
