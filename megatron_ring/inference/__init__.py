"""Inference: prefill and greedy decode of a model over a parallel layout, measured.

Files:

* ``schema.py``  the ``megatron_ring`` section of a DeepSpeed inference config;
* ``runners/``   the models a run serves (:mod:`megatron_ring.inference.runners`);
* ``loop.py``    requests: prefill, decode steps, timings;
* ``metrics.py`` TPS, TTFT, TPOT, bytes sent, the result table;
* ``main.py``    one rank's run (what ``launch/infer.py`` and ``megatron-ring infer`` start);
* ``compare.py`` ``megatron-ring compare``: baseline and ring under the launcher, side by side.
"""
