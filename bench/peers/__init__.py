"""beam-rl side by side with the rollout loops users would pick instead (issue 51): one harness
(`python -m bench.peers.compare`) runs every system against the same simulated fleet and prompts and measures
every column from outside; `job.py` is the contract a peer adapter implements."""
