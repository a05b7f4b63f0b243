"""Model runners the inference loop drives (``megatron_ring.model.runner`` in a config).

Files:

* ``protocol.py`` what a runner is: :class:`ModelRunner` (prefill, decode) and :class:`RunnerModule`;
* ``gpt.py``      a real Megatron-core GPT: the TP/PP baseline or ring attention with a CP-sharded KV cache;
  random weights, or a transformers checkpoint converted while loading;
* ``hf.py``       a transformers checkpoint: TP by DeepSpeed AutoTP, CP by the ring;
* ``checkpoint.py`` a checkpoint behind either runner: located, its config, loaded;
* ``toy.py``      a pure-torch model for tests without megatron-core.
"""
