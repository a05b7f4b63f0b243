"""Thin adapters over the core, one package per framework; none imports another.

* ``megatron/``  megatron-core (public names in :mod:`megatron_ring.megatron`);
* ``deepspeed/`` DeepSpeed's config, launcher environment, engines and AutoTP;
* ``hf/``        transformers (public names in :mod:`megatron_ring.hf`).
"""
