#!/usr/bin/env bash
# The prepared device check: every GPU item of ../shared/gpu-checklist.md in one command of at most
# 8 minutes on one H100 (megatron_ring/perf/bench/device_check.py writes OUT_DIR/device_check.{json,md}).
#
#   bash scripts/gpu_check.sh OUT_DIR                 on the lent GPU (through the device tool: OUT_DIR under $OUT)
#   bash scripts/gpu_check.sh OUT_DIR --cpu-dry-run   the same code paths, tiny sizes, on CPU (CI runs this)
#
# The device image has torch, transformers and triton but no megatron-core or DeepSpeed: wheels put in
# wheels/ (ignored by git; name it in the device tool's carry) are installed first, and the Megatron
# tests then run on the GPU machine's CPUs too (checklist item 5).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--cpu-dry-run]}
shift
python=${PYTHON:-}
if [ -z "$python" ]; then if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi; fi
if compgen -G "wheels/*.whl" >/dev/null; then "$python" -m pip install -q --no-deps wheels/*.whl; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
status=0
timeout 420 "$python" -m megatron_ring.perf.bench.device_check --out "$out" "$@" || status=$?
if [ $# -eq 0 ] && "$python" -c "import megatron.core" 2>/dev/null; then
    timeout 60 "$python" -m pytest -q -p no:cacheprovider tests/integration/test_megatron_spec.py || status=$?
fi
exit "$status"
