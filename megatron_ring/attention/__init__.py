"""The attention core, pure torch: sharding, block kernels, log-sum-exp merge, the ring, decode.

Files:

* ``sharding.py``           zigzag / contiguous shards of a sequence and their global positions;
* ``schedule.py``           which queries meet which keys at each ring step, also under a window or
                            packed documents (pure);
* ``window.py``             ``window_size``: checks, the band of allowed distances, masks (pure);
* ``sparse_call.py``        ``ring_attention``'s ``window_size`` and ``cu_seqlens``: checks, schedule, handshake;
* ``block.py``              one block's attention and its backward (math, torch's fused kernels, flash-attn);
* ``flash_attn_backend.py`` the flash-attn package's kernels behind ``backend="flash_attn"``;
* ``merge.py``              the fp32 log-sum-exp merge of partial results;
* ``ring.py``               ``ring_attention``: the p2p ring and its autograd function;
* ``direct.py``             window / packed-document transfers: owner to user, only the rows read;
* ``allgather.py``          the all-gather variant on the same schedule;
* ``alltoall.py``           ``comm="a2a"`` (Ulysses) and ``"a2a+p2p"`` (all-to-all x ring), ``CPGroups``;
* ``auto_comm.py``          ``comm="auto"``: p2p, all_gather, a2a or a2a+p2p from a cost model;
* ``decode.py``             ``decode_attention`` against a KV cache sharded over the CP group;
* ``ops.py``, ``opaque.py`` both as torch.library custom ops, for torch.compile (registered on import);
* ``checks.py``             validation at the boundary;
* ``instrument.py``         ``ring_stats``: bytes sent, compute and exposed communication time;
* ``reference.py``          float64 references for tests, benchmarks and the demo.
"""

import megatron_ring.attention.ops  # noqa: E402,F401  (registers torch.ops.megatron_ring.*)
