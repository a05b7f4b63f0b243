"""The attention core, pure torch: sharding, block kernels, log-sum-exp merge, the ring (one loop over pieces of work,
Note [Pieces] in ring.py) and its transports, the all-to-all comms, ``comm="auto"``, decode and follow-up turns.
docs/design.md lists the files and reads one call through them. ``ops.py`` registers the custom ops on import.
"""

import megatron_ring.attention.ops  # noqa: E402,F401  (registers torch.ops.megatron_ring.*)
