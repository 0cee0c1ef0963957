"""beam-rl's benchmarks, one folder per question (bench/README.md): `throughput` (how fast), `scale` (how big),
`cost`, `rewards`, `learning` and `recovery` (what it costs), `peers` (against the loops users would pick
instead), and `common`, what they share. Each script runs as `python -m bench.<family>.<name>` and writes its
results beside itself."""
