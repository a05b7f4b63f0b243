"""The attention core, pure torch: sharding, block kernels, log-sum-exp merge, the ring, decode.

Files (the reading path of one call is in api.py):

* ``api.py``                ``ring_attention``: checks, handshake, then the ring or the all-to-all;
* ``call.py``               the checks at the boundary, the ``RingCall`` record, the prepare step
                            both entry points share;
* ``comms.py``              the comm names and the CP groups they run over (``CPGroups``, ``CPPlace``);
* ``handshake.py``          cross-rank agreement on a call's arguments;
* ``sharding.py``           zigzag / contiguous shards of a sequence and their global positions;
* ``schedule.py``           which queries meet which keys at each ring step, also under a window or
                            packed documents: one ``Schedule`` per call (pure);
* ``window.py``             ``window_size``: the band of allowed distances, masks (pure);
* ``dilated.py``            ``dilation``: LongNet's dilated attention, its pieces in compact
                            coordinates (pure); ``dilated_schedule.py`` their schedules,
                            ``dilated_transport.py`` their rows through the plain transports;
* ``ring.py``               the one forward and backward loop of every variant (over pieces of
                            work, Note [Pieces]) and their autograd Function;
* ``transport.py``          the K/V transport protocol, posting, timed waits, ``ring_stats``;
* ``relay.py``              the relay ring (``comm="p2p"``);
* ``direct.py``             window / packed-document transfers: owner to user, only the rows read;
* ``gather.py``             ``comm="all_gather"``;
* ``alltoall.py``           ``comm="a2a"`` (Ulysses) and ``"a2a+p2p"`` (all-to-all x ring);
* ``auto_comm.py``          ``comm="auto"``: p2p, all_gather, a2a or a2a+p2p from a cost model;
* ``block.py``              one block's attention and its backward (math, torch's fused kernels,
                            flash-attn), and the fp32 log-sum-exp merge;
* ``flash_attn_backend.py`` the flash-attn package's kernels behind ``backend="flash_attn"``;
* ``decode.py``             ``decode_attention`` against a KV cache sharded over the CP group;
* ``ops.py``, ``opaque.py`` both as torch.library custom ops, for torch.compile (registered on import);
* ``reference.py``          float64 references for tests, benchmarks and the demo.
"""

import megatron_ring.attention.ops  # noqa: E402,F401  (registers torch.ops.megatron_ring.*)
