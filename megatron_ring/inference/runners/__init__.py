"""Model runners the inference loop drives (``megatron_ring.model.runner`` in a config).

Files:

* ``protocol.py`` what a runner is: :class:`ModelRunner` (prefill, decode) and :class:`RunnerModule`;
* ``gpt.py``      a real Megatron-core GPT: the TP/PP baseline or ring attention with a CP-sharded KV cache;
* ``toy.py``      a pure-torch model for tests without megatron-core.
"""
