"""A transformers checkpoint directory as :class:`~megatron_ring.integrations.megatron.hf_weights.HFWeights`,
read a slice at a time where it can be.

::

    weights = checkpoint_weights(Path("/checkpoint"))     # names and shapes checked, nothing read yet
    load_full_state_dict(model, weights)                   # this rank reads its stage, its TP slices

Note [Sharded loading]
~~~~~~~~~~~~~~~~~~~~~~
Loading the whole model on every rank and cutting it costs each rank the whole model in fp32 beside
its own part: on SmolLM2-135M (538 MB) the megatron runner's peak grew by 1.2 GiB over its imports at
pp 1 and still by 0.74 GiB per stage at pp 2 (docs/inference.md, "Sharded loading"). When the
directory's weights are safetensors files whose tensor names are the model's (what
``save_pretrained`` writes, and the GGUF conversion cache), the mapping reads them from the files
instead (:class:`~megatron_ring.integrations.megatron.tensor_source.SafetensorsTensors`): a
pipeline stage reads its own layers (and the embedding or output layer where it holds them), a TP
rank only its rows or columns (Note [TP slices of fused tensors] in ``hf_weights.py``), each slice
of one tensor straight into its parameter, so a rank's peak is its own share plus one fused slice.
The values are the file's, cast by the same ``copy_`` as before, so the model is bit for bit the
one the whole load gives.

Other checkpoints (``.bin`` files, or names transformers renames on load) still go through
transformers' whole load: it alone knows their renames. A GGUF file is first converted once to
the safetensors cache (Note [GGUF conversion cache] in ``integrations/hf/checkpoint.py``) and read
from there: GGUF stores quantised blocks in llama.cpp's layout (Q/K rows permuted for its RoPE)
that transformers de-quantises and permutes back, which slicing the GGUF file would have to redo.
"""
from __future__ import annotations

from pathlib import Path

from megatron_ring.integrations.megatron.hf_config import model_fields
from megatron_ring.integrations.megatron.hf_weights import HFWeights
from megatron_ring.integrations.megatron.tensor_source import SafetensorsTensors


def checkpoint_weights(directory: Path) -> HFWeights:
    """The :class:`HFWeights` of a checkpoint directory (``config.json`` and weights): read from its safetensors
    files when their names are the model's, else from transformers' whole load (Note [Sharded loading]).
    ValueError for an architecture the converter refuses, or a checkpoint whose tensors do not fit it."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, local_files_only=True).to_dict()
    model_fields(config)  # an architecture refused here is refused before any weight is read
    files = SafetensorsTensors.of(directory)
    if files is not None:
        try:
            return HFWeights(config, files)
        except ValueError:
            pass  # names the files keep but transformers renames: its whole load below decides
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    return HFWeights(model.config.to_dict(), model.state_dict())
