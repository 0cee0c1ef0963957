"""beam-rl's performance benchmark (issue 7): `python -m bench.run --size small|full`."""
