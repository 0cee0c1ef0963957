"""The benchmarks' own code: the peers harness' adapters (bench/peers/)."""
