"""What it costs, per rollout or per call: logging, the run observer, a reward program's start, checksums, replay,
a /metrics parse, an environment's way to the model, a weight update."""
