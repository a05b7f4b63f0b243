"""Megatron-core integration: ring attention as the ``core_attention`` leaf, and the CPU path of megatron-core.

Files:

* ``attention.py``   :class:`RingAttention`, the drop-in for ``DotProductAttention``;
* ``specs.py``       layer specs with the leaf swapped (``get_gpt_layer_ring_spec``, ``use_ring_attention``);
* ``batches.py``     Megatron's zigzag batch split and the gathers of sequences and logits;
* ``packed.py``      packed (THD) batches: documents packed and split per document, ``PackedSeqParams`` checks;
* ``state.py``       the one initialisation of ``parallel_state`` (:func:`init_megatron`) and views of its groups;
* ``model.py``       a real ``GPTModel`` from a ``configs/megatron`` file; unsharded weights in and out;
* ``hf_config.py``   which transformers checkpoints (Llama, Qwen2, Mistral) it can hold, as model fields;
* ``hf_weights.py``  their tensors as Megatron's unsharded state dict (fused Q/K/V per group, [gate; up]);
* ``tensor_source.py`` a state dict, or safetensors files read a slice at a time;
* ``hf_checkpoint.py`` a checkpoint folder as that state dict, each rank reading only its stage and TP slices;
* ``on_cpu.py``      megatron-core on CPU: every patched internal in one table, guarded by the checked versions;
* ``pipeline.py``    one pipeline stage's forward and backward with send/recv;
* ``equivalence.py`` a config (or a packed batch) against the same model at cp = 1 (``python -m megatron_ring.megatron``).

Users import the public names from :mod:`megatron_ring.megatron`.
"""
