"""For tests only, ours and users': nothing outside tests imports it (tests/unit/test_layering.py).

Files:

* ``gloo.py``    :class:`GlooPool`, a function on N CPU ranks (from :mod:`megatron_ring.runtime.pool`);
* ``fake.py``    a fake process group of any world size (no data moves: never assert numbers);
* ``tiny_hf.py`` tiny random transformers models and a byte tokenizer, built locally
  (``python -m megatron_ring.testing.tiny_hf llama DIR`` writes one);
* ``configs.py`` dotted-key edits of config mappings.
"""
