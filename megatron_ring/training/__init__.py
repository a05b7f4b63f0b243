"""Training with ring attention: DeepSpeed's engine over a Megatron GPT or a transformers causal LM,
CP-aware gradient reduction.

* :mod:`~megatron_ring.training.schema` — the ``megatron_ring`` section of a DeepSpeed training JSON;
* :mod:`~megatron_ring.training.megatron_args` — a training YAML with Megatron-LM's names, translated into it;
* :mod:`~megatron_ring.training.megatron_section`, :mod:`~megatron_ring.training.megatron_engine` — ``engine:
  megatron``: its section and Megatron-core's training stack;
* :mod:`~megatron_ring.training.hf_schema` — its ``transformers`` entry (which transformers model to train);
* :mod:`~megatron_ring.training.hf_model` — that model built, and its per-token losses on a zigzag shard;
* :mod:`~megatron_ring.training.data` — byte-level tokens of local text, packed, DP split, zigzag CP shards;
* :mod:`~megatron_ring.training.checkpoint` — complete markers, checksums, the recorded layout, write errors;
* :mod:`~megatron_ring.training.loop` — the loop, metrics, resume and the non-finite-loss stop; ``train_main``
  is what ``launch/train.py`` and ``python -m megatron_ring.train`` run.

Importing this package needs pydantic and torch only; DeepSpeed, megatron-core and transformers
are imported when a run starts (``hf_model`` imports transformers itself).
"""
