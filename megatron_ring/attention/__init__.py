"""Pure-torch attention core: sharding, block attention, log-sum-exp merge, the ring, decode."""
