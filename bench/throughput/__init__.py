"""How fast: rollouts/s through the whole pipeline against a plain loop, engine occupancy, the sink, the in-flight
cap, streaming on each runner."""
