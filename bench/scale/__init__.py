"""How big: one dispatch shard against fleets of 10 to 1,000 servers, a fleet that grows and shrinks, the single-
key packer's ceiling and its state."""
