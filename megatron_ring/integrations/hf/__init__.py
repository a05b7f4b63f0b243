"""Hugging Face transformers models with ring attention over a context-parallel (CP) group.

Everything goes through transformers' public extension points: an ``AttentionInterface`` entry
``"ring"``, its ``AttentionMaskInterface`` entry (without one, transformers hands custom attention
no mask at all and padded batches would be silently wrong), and a :class:`RingCache` (a ``Cache``).
No model code is patched::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring")
    logits = ring_forward(model, input_ids, attention_mask, group=cp_group)      # [batch, seq, vocab]
    tokens = ring_generate(model, input_ids, attention_mask, group=cp_group, max_new_tokens=32)
    torch.manual_seed(0)  # the same seed on every rank
    sampled = ring_generate(model, input_ids, attention_mask, group=cp_group, do_sample=True, top_p=0.9)
    beams = ring_generate(model, input_ids, attention_mask, group=cp_group, num_beams=4)

Every rank of the CP group calls these with the same *global* ``input_ids`` and gets the same
result; each rank embeds, projects and attends only its own zigzag shard of the prompt.

Files:

* ``context.py``   the CP group of the running model call (:func:`cp_context`);
* ``attention.py`` the ``"ring"`` attention and mask functions, their registration, model checks;
* ``cache.py``     :class:`RingCache`, the KV cache sharded over the CP group;
* ``inputs.py``    global inputs -> this rank's zigzag shard (padding, sharding, gathering);
* ``generate.py``  :func:`ring_forward` and :func:`ring_generate` (transformers' ``generate``, every mode);
* ``recompute.py`` ``use_cache=False``: every ``generate`` step a ring prefill.

Users import the public names from :mod:`megatron_ring.hf` (which also registers ``"ring"``).
"""
