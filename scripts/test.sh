#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite (unit, gloo, fake world 16, integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
