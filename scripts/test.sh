#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite (unit, gloo, fake world 16, integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1
# The suite starts a few hundred Python processes (ranks, launchers, commands); compile the project's
# own modules once so that none of them compiles them again (site-packages are compiled at install).
.venv/bin/python -m compileall -q megatron_ring launch tests >/dev/null
# Two test processes: the launcher tests beside the rest (Note [Two test processes] in tests/conftest.py).
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup tests "$@"
